package dataconn

import (
	"context"
	"errors"
	"testing"
)

// cleanMem is a memBackend that counts clean flushes, with and without
// the request's epoch.
type cleanMem struct {
	*memBackend
	cleans, epochCleans int
}

func (c *cleanMem) FlushClean() error { c.cleans++; return nil }

func (c *cleanMem) FlushCleanEpoch(e uint64) error {
	if err := c.checkEpoch(e); err != nil {
		return err
	}
	c.epochCleans++
	return nil
}

// TestFlushClean: a clean flush reaches a backend that takes them, with
// the request's epoch checked; a backend without a record to clean gets a
// plain flush, as a server older than clean flushes does.
func TestFlushClean(t *testing.T) {
	ctx := context.Background()
	c := &cleanMem{memBackend: newMem(1 << 20)}
	cl := pipePair(t, c, 1, ClientOptions{})
	if err := cl.FlushClean(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if c.epochCleans != 1 || c.cleans != 0 || c.flushes != 1 {
		t.Fatalf("after a clean and a plain flush: %d clean (epoch), %d clean, %d plain; want 1, 0, 1", c.epochCleans, c.cleans, c.flushes)
	}
	cl.SetEpoch(7)
	if err := cl.FlushClean(ctx); !errors.Is(err, CodeStaleEpoch) {
		t.Fatalf("a clean flush of a stale epoch: %v, want CodeStaleEpoch", err)
	}
	if c.epochCleans != 1 {
		t.Fatalf("a refused clean flush was run: %d", c.epochCleans)
	}

	plain := newMem(1 << 20)
	pcl := pipePair(t, plainBackend{plain}, 1, ClientOptions{})
	if err := pcl.FlushClean(ctx); err != nil {
		t.Fatal(err)
	}
	if plain.flushes != 1 {
		t.Fatalf("a clean flush to a backend without a record: %d plain flushes, want 1", plain.flushes)
	}
}

// plainBackend hides memBackend's epoch methods: a Backend only.
type plainBackend struct{ m *memBackend }

func (p plainBackend) ReadAt(b []byte, off int64) (int, error)  { return p.m.ReadAt(b, off) }
func (p plainBackend) WriteAt(b []byte, off int64) (int, error) { return p.m.WriteAt(b, off) }
func (p plainBackend) Flush() error                             { return p.m.Flush() }
func (p plainBackend) Unmap(off, n int64) error                 { return p.m.Unmap(off, n) }
func (p plainBackend) Size() int64                              { return p.m.Size() }
