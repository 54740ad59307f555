module github.com/cairn-io/cairn/dataplane

go 1.26.0
