package rebuildcodec

import "google.golang.org/grpc"

// DialOptions are the transport options of a connection that carries
// rebuild data, which moves in 4 MiB messages, several at once: flow
// control windows that hold such a message whole, so that no sender waits
// for a window update mid-message, and buffers that write and read it in
// few system calls. The engine's replica client and a target replica
// pulling chunks from its source both dial with them.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithInitialWindowSize(16 << 20), grpc.WithInitialConnWindowSize(32 << 20),
		grpc.WithWriteBufferSize(1 << 20), grpc.WithReadBufferSize(1 << 20),
	}
}
