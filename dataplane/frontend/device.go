// Package frontend holds what the frontends (frontend/nbd, frontend/fuse)
// share: the block device they expose, which the engine implements.
package frontend

import "context"

// Device is a block device a frontend serves.
type Device interface {
	ReadAt(ctx context.Context, p []byte, off int64) error
	WriteAt(ctx context.Context, p []byte, off int64, fua bool) error
	Flush(ctx context.Context) error
	// Unmap discards a range; it reads as zeros afterwards.
	Unmap(ctx context.Context, off, length int64) error
	Size() int64
}
