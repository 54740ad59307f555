package rebuildcodec

import "google.golang.org/grpc"

// The transport sizes of a connection that carries rebuild data, which
// moves in 4 MiB messages, several at once: flow control windows that
// hold such a message whole, so that no sender waits for a window update
// mid-message, and buffers that write and read it in few system calls.
const (
	streamWindow = 16 << 20
	connWindow   = 32 << 20
	ioBuffer     = 1 << 20
)

// DialOptions are the transport options of a client that carries rebuild
// data: the engine's replica client and a target replica pulling chunks
// from its source.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithInitialWindowSize(streamWindow), grpc.WithInitialConnWindowSize(connWindow),
		grpc.WithWriteBufferSize(ioBuffer), grpc.WithReadBufferSize(ioBuffer),
	}
}

// ServerOptions are the same for the replica's control server.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow),
		grpc.WriteBufferSize(ioBuffer), grpc.ReadBufferSize(ioBuffer),
	}
}
