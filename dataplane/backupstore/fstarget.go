package backupstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// tempPrefix starts the name of a file being written by DirTarget.Put.
// Such files are never listed; one left by a crash is safe to delete.
const tempPrefix = ".tmp-"

// DirTarget is a Target in a directory of a filesystem: typically an NFS
// export the caller has mounted. An object is a file at the key's path
// under the directory. Put writes a temporary file in the same directory,
// fsyncs it, renames it over the key and fsyncs the directory, so an
// object is either absent or complete, also across a crash of the writer
// or the file server.
//
// Every call runs in its own goroutine and returns when its context is
// done, even if the system call under it hangs (a hard NFS mount whose
// server went away); the abandoned goroutine ends when the kernel returns.
type DirTarget struct {
	root string
}

// NewDirTarget returns a target in dir, which must exist.
func NewDirTarget(dir string) (*DirTarget, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("backup target directory: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("backup target %s is not a directory", dir)
	}
	return &DirTarget{root: dir}, nil
}

func (t *DirTarget) path(key string) string { return filepath.Join(t.root, filepath.FromSlash(key)) }

// Put implements Target.
func (t *DirTarget) Put(ctx context.Context, key string, data []byte) error {
	return runCtx(ctx, func() error { return fsError(writeFileAtomic(t.path(key), data)) })
}

func writeFileAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := filepath.Join(dir, tempPrefix+filepath.Base(path)+"-"+hex.EncodeToString(rnd[:]))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = os.Remove(tmp)
		}
	}()
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}

// Get implements Target.
func (t *DirTarget) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	var f *os.File
	err := runCtx(ctx, func() error {
		var err error
		f, err = os.Open(t.path(key))
		return fsError(err)
	})
	if err != nil {
		return nil, err
	}
	return &ctxReader{ctx: ctx, f: f}, nil
}

// Delete implements Target.
func (t *DirTarget) Delete(ctx context.Context, key string) error {
	return runCtx(ctx, func() error {
		err := os.Remove(t.path(key))
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fsError(err)
	})
}

// List implements Target. It walks only the directory the prefix names
// (its part up to the last "/").
func (t *DirTarget) List(ctx context.Context, prefix string, fn func(Object) error) error {
	base := prefix[:strings.LastIndex(prefix, "/")+1]
	var objs []Object
	err := runCtx(ctx, func() error {
		var err error
		objs, err = t.walk(ctx, base, prefix)
		return fsError(err)
	})
	if err != nil {
		return err
	}
	for _, o := range objs {
		if err := fn(o); err != nil {
			return err
		}
	}
	return nil
}

func (t *DirTarget) walk(ctx context.Context, base, prefix string) ([]Object, error) {
	var objs []Object
	err := filepath.WalkDir(t.path(base), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if d.IsDir() || strings.HasPrefix(d.Name(), tempPrefix) {
			return nil
		}
		rel, err := filepath.Rel(t.root, p)
		if err != nil {
			return err
		}
		key := filepath.ToSlash(rel)
		if !strings.HasPrefix(key, prefix) {
			return nil
		}
		info, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil // deleted while we walked
		}
		if err != nil {
			return err
		}
		objs = append(objs, Object{Key: key, Size: info.Size(), ModTime: info.ModTime()})
		return nil
	})
	return objs, err
}

// fsError maps a filesystem error to the Target conventions: a missing file
// is ErrNotFound; errors a retry may cure (an NFS server that timed out or
// restarted) are Transient.
func fsError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	case errors.Is(err, syscall.EIO), errors.Is(err, syscall.ETIMEDOUT), errors.Is(err, syscall.EAGAIN),
		errors.Is(err, syscall.ESTALE), errors.Is(err, syscall.EINTR):
		return Transient(err)
	}
	return err
}

// runCtx runs fn and waits for it or for ctx, whichever is first.
func runCtx(ctx context.Context, fn func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ctxReader reads a file so that each Read returns when ctx is done. The
// read runs into a buffer of its own, so an abandoned read never writes
// into the caller's slice after Read has returned.
type ctxReader struct {
	ctx context.Context
	f   *os.File
	buf []byte
}

func (r *ctxReader) Read(p []byte) (int, error) {
	if len(p) > 1<<20 {
		p = p[:1<<20]
	}
	type result struct {
		n   int
		err error
		buf []byte
	}
	buf := r.buf
	r.buf = nil
	if cap(buf) < len(p) {
		buf = make([]byte, len(p))
	}
	buf = buf[:len(p)]
	done := make(chan result, 1)
	go func() {
		n, err := r.f.Read(buf)
		done <- result{n, err, buf}
	}()
	select {
	case res := <-done:
		copy(p, res.buf[:res.n])
		r.buf = res.buf
		if res.err != nil && !errors.Is(res.err, io.EOF) {
			return res.n, fsError(res.err)
		}
		return res.n, res.err
	case <-r.ctx.Done():
		return 0, r.ctx.Err()
	}
}

func (r *ctxReader) Close() error { return r.f.Close() }
