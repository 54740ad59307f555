// Package shm is the shared memory between an engine and the replicas on
// its own node: the engine creates a Region (a sealed memfd it maps
// read-write), hands its descriptor to a replica over a unix socket, and the
// replica maps it read-only (Map). A write whose payload already lies in the
// region then crosses to the replica as an 8-byte offset instead of as
// bytes on a socket (docs/dataconn.md, "Shared memory").
//
// Arena hands out request buffers from a Region, so that the NBD frontend
// reads a write's payload from its client straight into shared memory;
// without a Region it is the size-class buffer pool of the data path (the
// NBD server and the dataconn server use it so).
package shm

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Region is shared memory the engine owns, mapped read-write.
type Region struct {
	fd  int
	mem []byte
}

// seals keep the region's size fixed for its lifetime: a replica that
// mapped it can never fault on pages past a shrunk end.
const seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// Create makes a sealed memfd of size bytes and maps it. name shows in
// /proc/PID/fd and /proc/PID/maps. Pages are allocated only when touched.
func Create(name string, size int) (*Region, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: size %d: must be positive", size)
	}
	fd, err := unix.MemfdCreate("cairn-"+name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("shm: memfd_create: %w", err)
	}
	fail := func(what string, err error) (*Region, error) {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		return fail("seal", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap", err)
	}
	return &Region{fd: fd, mem: mem}, nil
}

// FD is the descriptor to pass to a replica. It stays owned by r.
func (r *Region) FD() int { return r.fd }

// Size is the region's length in bytes.
func (r *Region) Size() int { return len(r.mem) }

// Bytes is the whole mapping.
func (r *Region) Bytes() []byte { return r.mem }

// Offset reports where p lies in the region, and whether all of it does.
func (r *Region) Offset(p []byte) (uint64, bool) {
	mem := r.mem
	if len(p) == 0 || len(mem) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	if at < base || at-base > uintptr(len(mem)) || uintptr(len(p)) > uintptr(len(mem))-(at-base) {
		return 0, false
	}
	return uint64(at - base), true
}

// punch frees the memory behind [off, off+size) (it reads as zeros after).
func (r *Region) punch(off, size uint64) error {
	if err := unix.Fallocate(r.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(off), int64(size)); err != nil {
		return fmt.Errorf("shm: releasing %d bytes at %d: %w", size, off, err)
	}
	return nil
}

// Resident reports how many bytes of the region hold memory.
func (r *Region) Resident() (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(r.fd, &st); err != nil {
		return 0, fmt.Errorf("shm: fstat: %w", err)
	}
	return st.Blocks * 512, nil
}

// Close unmaps the region and closes its descriptor. Buffers from it must
// no longer be in use.
func (r *Region) Close() error {
	err := unix.Munmap(r.mem)
	r.mem = nil
	return errors.Join(err, unix.Close(r.fd))
}

// Mapping is a replica's read-only view of an engine's Region.
type Mapping struct {
	mem []byte
}

// Map maps the region behind fd read-only. It refuses a descriptor that is
// not a sealed memfd of fixed size, or one smaller than want bytes. fd stays
// the caller's to close.
func Map(fd int, want uint64) (*Mapping, error) {
	got, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: not a sealable memfd: %w", err)
	}
	if got&(unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL) != unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL {
		return nil, fmt.Errorf("shm: the memfd can still shrink (seals 0x%x)", got)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("shm: fstat: %w", err)
	}
	if st.Size <= 0 || uint64(st.Size) < want || st.Size > 1<<40 {
		return nil, fmt.Errorf("shm: the memfd holds %d bytes, the peer announced %d", st.Size, want)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: mmap: %w", err)
	}
	return &Mapping{mem: mem}, nil
}

// Slice returns the n bytes at off, or false when they are not all inside
// the mapping.
func (m *Mapping) Slice(off uint64, n uint32) ([]byte, bool) {
	if n == 0 || off > uint64(len(m.mem)) || uint64(n) > uint64(len(m.mem))-off {
		return nil, false
	}
	return m.mem[off : off+uint64(n) : off+uint64(n)], true
}

// Close unmaps the mapping; slices from it must no longer be in use.
func (m *Mapping) Close() error {
	err := unix.Munmap(m.mem)
	m.mem = nil
	return err
}
