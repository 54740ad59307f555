module github.com/cairn-io/cairn/dataplane

go 1.26.0

require (
	github.com/go-logr/logr v1.4.3 // indirect
	golang.org/x/sys v0.48.0 // indirect
)
