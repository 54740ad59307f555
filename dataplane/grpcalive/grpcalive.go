// Package grpcalive is how Cairn's gRPC clients notice a peer that went
// silent (a node powered off, a process stopped, a dropped network) and
// what its servers accept of that.
//
// Without keepalive a client sees such a peer only when TCP gives up,
// minutes later: the manager would think an instance manager or engine of
// a dead node reachable, and its processes' states current. With it, a
// connection that does not answer a ping within PingTimeout of PingEvery
// of silence is closed, and streams on it fail at once.
package grpcalive

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

const (
	// PingEvery is how long a client lets a connection be silent before
	// it pings.
	PingEvery = 10 * time.Second
	// PingTimeout is how long it waits for the answer.
	PingTimeout = 5 * time.Second
	// minPingInterval is the most often a server lets a client ping:
	// under PingEvery, so a client of this package is never told off, and
	// far above what would load a server.
	minPingInterval = 5 * time.Second
)

// Dial is the client side: ping a silent connection, streams or not.
func Dial() grpc.DialOption {
	return grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: PingEvery, Timeout: PingTimeout, PermitWithoutStream: true})
}

// Serve is the server side: accept the pings Dial sends. gRPC's default
// policy closes a connection pinged more often than every five minutes.
func Serve() grpc.ServerOption {
	return grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: minPingInterval, PermitWithoutStream: true})
}
