// Package stream keeps a server-streaming gRPC watch going: the loop of
// watching, noticing the break and watching again with back-off that the
// instance-manager pool and the engine watches share.
package stream

import (
	"context"
	"time"
)

// Keep calls once until ctx ends. once runs one stream until it breaks
// and reports whether it got anything (then the next attempt comes after
// lo again) and why it broke; broke is told that error before the wait.
// The wait doubles from lo up to hi while attempts get nothing.
func Keep(ctx context.Context, lo, hi time.Duration, once func(context.Context) (got bool, err error), broke func(error)) {
	backoff := lo
	for ctx.Err() == nil {
		got, err := once(ctx)
		if ctx.Err() != nil {
			return
		}
		broke(err)
		if got {
			backoff = lo // it worked for a while: retry soon
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, hi)
	}
}
