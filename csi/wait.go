package csi

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
)

func formatProto(m proto.Message) string {
	return prototext.MarshalOptions{}.Format(m)
}

// waitFor calls check with a growing pause (50 ms to 1 s) until it reports
// done or fails, or ctx ends. On ctx's end the error is DeadlineExceeded
// (or Canceled) with what the last check said was missing, so the caller
// (which retries) sees why.
func waitFor(ctx context.Context, what string, check func() (done bool, missing string, err error)) error {
	pause := 50 * time.Millisecond
	for {
		done, missing, err := check()
		if err != nil || done {
			return err
		}
		select {
		case <-ctx.Done():
			code := codes.DeadlineExceeded
			if ctx.Err() == context.Canceled {
				code = codes.Canceled
			}
			return status.Errorf(code, "timed out waiting for %s: %s; the call may be retried", what, missing)
		case <-time.After(pause):
		}
		if pause *= 2; pause > time.Second {
			pause = time.Second
		}
	}
}

// keyLocks serialises the calls on one volume or snapshot. A second call
// for a key in use fails with Aborted, as the CSI spec asks: the caller
// retries once the first is done.
type keyLocks struct {
	mu   sync.Mutex
	busy map[string]bool
}

func newKeyLocks() *keyLocks { return &keyLocks{busy: map[string]bool{}} }

// lock takes key or returns an Aborted error; the returned func releases it.
func (l *keyLocks) lock(key string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.busy[key] {
		return nil, status.Errorf(codes.Aborted, "an operation on %s is already in progress; retry once it is done", key)
	}
	l.busy[key] = true
	return func() {
		l.mu.Lock()
		delete(l.busy, key)
		l.mu.Unlock()
	}, nil
}
