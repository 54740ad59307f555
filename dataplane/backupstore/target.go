package backupstore

import (
	"context"
	"errors"
	"io"
	"time"
)

// Target is where a Store keeps its objects: a flat namespace of keys
// ("volumes/vol-1/index") mapped to immutable byte strings. Keys use "/"
// as separator and never start with "/" or contain "." or ".." elements.
//
// Implementations must make Put atomic (a reader sees the whole new
// object, the whole old one, or none) and read-after-write consistent,
// report ErrNotFound (wrapped is fine) for a missing key, and mark errors
// that a retry may cure with Transient. They need not retry or bound
// calls themselves: the Store wraps every call in a timeout and retries.
type Target interface {
	// Put stores data under key, replacing any object there.
	Put(ctx context.Context, key string, data []byte) error
	// Get opens key for reading. The reader must honour ctx: a read
	// that cannot finish returns once ctx is done.
	Get(ctx context.Context, key string) (io.ReadCloser, error)
	// Delete removes key; a missing key is not an error.
	Delete(ctx context.Context, key string) error
	// List calls fn for every object whose key starts with prefix, in no
	// particular order. An error from fn stops the listing and is returned.
	List(ctx context.Context, prefix string, fn func(Object) error) error
}

// Object describes a stored object as List reports it.
type Object struct {
	// Key is the full key.
	Key string
	// Size is the object's length in bytes.
	Size int64
	// ModTime is when the object was last written, by the target's clock
	// (the S3 server's Last-Modified, the file server's mtime): leases and
	// garbage collection compare these times with each other, never with
	// the local clock, so clock skew between writers does not matter.
	ModTime time.Time
}

// ErrNotFound is returned (wrapped) for an object that does not exist.
var ErrNotFound = errors.New("object not found")

// ErrTransient marks an error that a retry of the same call may cure (a
// timeout, a connection reset, an S3 503 SlowDown). Targets wrap such
// errors with Transient; the Store retries only these.
var ErrTransient = errors.New("transient")

// Transient marks err as worth retrying.
func Transient(err error) error {
	if err == nil {
		return nil
	}
	return transientError{err}
}

type transientError struct{ err error }

func (e transientError) Error() string { return e.err.Error() }
func (e transientError) Unwrap() []error {
	return []error{e.err, ErrTransient}
}
