package dataconn

import (
	"bytes"
	"fmt"
	"sync"
)

// memBackend is an in-memory Backend for this package's unit tests. hook,
// when set, runs before each operation (to block or fail it).
type memBackend struct {
	mu      sync.Mutex
	data    []byte
	epoch   uint64
	flushes int
	hook    func(op Op, off int64) error
}

func newMem(size int) *memBackend { return &memBackend{data: make([]byte, size)} }

// hold makes m's requests of type op wait until release is called (any
// number of times).
func (m *memBackend) hold(op Op) (release func()) {
	ch := make(chan struct{})
	var once sync.Once
	m.hook = func(o Op, off int64) error {
		if o == op {
			<-ch
		}
		return nil
	}
	return func() { once.Do(func() { close(ch) }) }
}

func (m *memBackend) run(op Op, off int64) error {
	if m.hook != nil {
		return m.hook(op, off)
	}
	return nil
}

func (m *memBackend) ReadAt(p []byte, off int64) (int, error) {
	if err := m.run(OpRead, off); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return copy(p, m.data[off:]), nil
}

func (m *memBackend) WriteAt(p []byte, off int64) (int, error) {
	if err := m.run(OpWrite, off); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return copy(m.data[off:], p), nil
}

func (m *memBackend) Flush() error {
	if err := m.run(OpFlush, 0); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.flushes++
	return nil
}

func (m *memBackend) Unmap(off, length int64) error {
	if err := m.run(OpUnmap, off); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.data[off : off+length])
	return nil
}

func (m *memBackend) Size() int64 { return int64(len(m.data)) }

// contents returns a copy of the backend's data, taken under its lock.
func (m *memBackend) contents() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return bytes.Clone(m.data)
}

func (m *memBackend) checkEpoch(e uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e != m.epoch {
		return fmt.Errorf("%w: request epoch %d, replica epoch %d", CodeStaleEpoch, e, m.epoch)
	}
	return nil
}

// The epoch variants check first; memBackend's epoch never changes while
// a test runs, so check-then-act is enough here.
func (m *memBackend) ReadAtEpoch(p []byte, off int64, e uint64) (int, error) {
	if err := m.checkEpoch(e); err != nil {
		return 0, err
	}
	return m.ReadAt(p, off)
}

func (m *memBackend) WriteAtEpoch(p []byte, off int64, e uint64) (int, error) {
	if err := m.checkEpoch(e); err != nil {
		return 0, err
	}
	return m.WriteAt(p, off)
}

func (m *memBackend) FlushEpoch(e uint64) error {
	if err := m.checkEpoch(e); err != nil {
		return err
	}
	return m.Flush()
}

func (m *memBackend) UnmapEpoch(off, n int64, e uint64) error {
	if err := m.checkEpoch(e); err != nil {
		return err
	}
	return m.Unmap(off, n)
}
