module github.com/cairn-io/cairn/dataplane

go 1.26.0

require (
	github.com/anishathalye/porcupine v1.3.1
	github.com/go-logr/logr v1.4.4
	github.com/hanwen/go-fuse/v2 v2.12.1
	golang.org/x/crypto v0.59.0
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/text v0.44.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
)
