package backupstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// NFSConfig says where an NFSv3 export is and how to reach it.
type NFSConfig struct {
	// Server is the NFS server's host name or IP address.
	Server string
	// Export is the exported path, as the server's MOUNT service knows it
	// ("/srv/backups").
	Export string
	// Prefix is a sub-directory of the export the target keeps its objects
	// in ("cluster-a/"), created if missing, so several stores can share
	// an export. Empty uses the export's root.
	Prefix string
	// MountPort and NFSPort are the TCP ports of the MOUNT and NFS
	// services; 0 asks the server's portmapper (port 111) for them.
	MountPort int
	NFSPort   int
	// UID and GID are the AUTH_UNIX identity of every call; the files the
	// target writes belong to them unless the export squashes ids.
	UID, GID uint32
}

// nfsPoolSize bounds the idle connections an NFS target keeps.
const nfsPoolSize = 8

// nfsMaxDepth bounds how deep List descends below the listed directory.
const nfsMaxDepth = 16

// NFSTarget is a Target in a directory of an NFSv3 export, spoken to over
// TCP from user space: nothing is mounted and no privilege is needed. An
// object is a file at the key's path under the directory, laid out as
// DirTarget lays it out. Put creates a temporary file, writes it with
// FILE_SYNC and renames it over the key, so an object is either absent
// or complete, also across a crash of the writer or the server.
//
// The target connects on first use (portmapper, MOUNT, FSINFO) and again
// after the server reports a stale handle. Calls run on a small pool of
// connections; each call's connection deadline follows its context.
type NFSTarget struct {
	cfg  NFSConfig
	auth rpcAuth
	// pmapPort is the portmapper's port: pmapPort, except in tests.
	pmapPort int

	mu   sync.Mutex
	sess *nfsSession
	// closed: Close was called; no new session is made.
	closed bool
}

// nfsSession is one mount of the export: the handle of the target's
// directory, the I/O sizes, and the handles of directories found so far.
type nfsSession struct {
	pool         *nfsConnPool
	root         []byte
	rtmax, wtmax int

	mu   sync.Mutex
	dirs map[string][]byte
}

// NewNFSTarget returns a target for cfg. It does not contact the server.
func NewNFSTarget(cfg NFSConfig) (*NFSTarget, error) {
	if cfg.Server == "" || strings.ContainsAny(cfg.Server, "/ ") {
		return nil, fmt.Errorf("NFS target: server %q: give a host name or IP address", cfg.Server)
	}
	if !strings.HasPrefix(cfg.Export, "/") || len(cfg.Export) > 1024 {
		return nil, fmt.Errorf("NFS target: export %q: give the exported path, such as /srv/backups", cfg.Export)
	}
	if _, err := splitPath(cfg.Prefix); err != nil {
		return nil, fmt.Errorf("NFS target: prefix: %w", err)
	}
	for _, p := range []int{cfg.MountPort, cfg.NFSPort} {
		if p < 0 || p > 65535 {
			return nil, fmt.Errorf("NFS target: port %d out of range", p)
		}
	}
	host, _ := os.Hostname()
	if len(host) > 255 {
		host = host[:255]
	}
	return &NFSTarget{cfg: cfg, auth: rpcAuth{machine: host, uid: cfg.UID, gid: cfg.GID}, pmapPort: pmapPort}, nil
}

// splitPath splits a "/"-separated relative path into its elements,
// refusing empty, "." and ".." elements and over-long names. Leading and
// trailing "/" are ignored.
func splitPath(p string) ([]string, error) {
	p = strings.Trim(p, "/")
	if p == "" {
		return nil, nil
	}
	parts := strings.Split(p, "/")
	for _, e := range parts {
		if e == "" || e == "." || e == ".." || len(e) > nfsMaxName || strings.IndexByte(e, 0) >= 0 {
			return nil, fmt.Errorf("path %q: bad element %q", p, e)
		}
	}
	return parts, nil
}

// splitKey splits a key into its directory's elements and its name.
func splitKey(key string) ([]string, string, error) {
	parts, err := splitPath(key)
	if err != nil {
		return nil, "", err
	}
	if len(parts) == 0 || strings.HasSuffix(key, "/") || strings.HasPrefix(key, "/") {
		return nil, "", fmt.Errorf("bad key %q", key)
	}
	return parts[:len(parts)-1], parts[len(parts)-1], nil
}

// Close closes the target's connections: the idle ones at once, those of
// calls still running when they end (a call still connecting closes its
// own). Calls after it fail with ErrTargetClosed.
func (t *NFSTarget) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	if t.sess != nil {
		t.sess.pool.close()
		t.sess = nil
	}
	return nil
}

// ErrTargetClosed is what a call on a closed NFS target fails with.
var ErrTargetClosed = errors.New("NFS target: closed")

// session returns the current mount, mounting the export if needed.
func (t *NFSTarget) session(ctx context.Context) (*nfsSession, error) {
	t.mu.Lock()
	s, closed := t.sess, t.closed
	t.mu.Unlock()
	if closed {
		return nil, ErrTargetClosed
	}
	if s != nil {
		return s, nil
	}
	s, err := t.connect(ctx)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.closed: // closed while connecting: this call's connections close when it ends
		s.pool.close()
		return s, nil
	case t.sess != nil: // another call connected meanwhile
		s.pool.close()
		return t.sess, nil
	}
	t.sess = s
	return s, nil
}

// check forgets the session s after a stale handle, so the next call
// mounts again, and returns err.
func (t *NFSTarget) check(s *nfsSession, err error) error {
	var st *nfsStatus
	if errors.As(err, &st) && st.status == nfsErrStale {
		t.mu.Lock()
		if t.sess == s {
			t.sess = nil
			s.pool.close()
		}
		t.mu.Unlock()
	}
	return err
}

func (t *NFSTarget) servicePort(ctx context.Context, port int, prog uint32) (string, error) {
	if port == 0 {
		var err error
		pm := net.JoinHostPort(t.cfg.Server, strconv.Itoa(t.pmapPort))
		if port, err = pmapGetport(ctx, t.cfg.Server, pm, prog, 3); err != nil {
			return "", err
		}
	}
	return net.JoinHostPort(t.cfg.Server, strconv.Itoa(port)), nil
}

func (t *NFSTarget) connect(ctx context.Context) (*nfsSession, error) {
	mountAddr, err := t.servicePort(ctx, t.cfg.MountPort, mountProg)
	if err != nil {
		return nil, err
	}
	nfsAddr, err := t.servicePort(ctx, t.cfg.NFSPort, nfsProg)
	if err != nil {
		return nil, err
	}
	root, err := mount(ctx, mountAddr, t.auth, t.cfg.Export)
	if err != nil {
		return nil, err
	}
	pool := newNFSConnPool(nfsAddr, t.auth, nfsPoolSize)
	rtmax, wtmax, err := pool.fsinfo(ctx, root)
	if err != nil {
		pool.close()
		return nil, err
	}
	s := &nfsSession{pool: pool, root: root, rtmax: ioSize(rtmax), wtmax: ioSize(wtmax), dirs: map[string][]byte{}}
	prefix, _ := splitPath(t.cfg.Prefix)
	if s.root, err = s.dir(ctx, prefix, true); err != nil {
		pool.close()
		return nil, fmt.Errorf("NFS target prefix %q: %w", t.cfg.Prefix, err)
	}
	s.dirs = map[string][]byte{}
	return s, nil
}

// ioSize bounds a server's preferred transfer size to what the target's
// reply bound allows, with a floor for servers that report none.
func ioSize(n uint32) int {
	switch {
	case n == 0:
		return 32 << 10
	case n < 512:
		return 512
	case n > nfsMaxIO:
		return nfsMaxIO
	}
	return int(n)
}

// dir returns the handle of the directory at the path elems below the
// session's root, creating missing directories if create is set.
func (s *nfsSession) dir(ctx context.Context, elems []string, create bool) ([]byte, error) {
	fh := s.root
	for i, name := range elems {
		path := strings.Join(elems[:i+1], "/")
		s.mu.Lock()
		cached := s.dirs[path]
		s.mu.Unlock()
		if cached != nil {
			fh = cached
			continue
		}
		next, err := s.lookupDir(ctx, fh, name, create)
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		s.dirs[path] = next
		s.mu.Unlock()
		fh = next
	}
	return fh, nil
}

func (s *nfsSession) lookupDir(ctx context.Context, parent []byte, name string, create bool) ([]byte, error) {
	fh, attr, err := s.pool.lookup(ctx, parent, name)
	if errors.Is(err, ErrNotFound) && create {
		fh, err = s.pool.mkdir(ctx, parent, name)
		if errors.Is(err, os.ErrExist) { // made by a concurrent call
			fh, attr, err = s.pool.lookup(ctx, parent, name)
		} else {
			attr.typ = nfsTypeDir
		}
	}
	if err != nil {
		return nil, err
	}
	if attr.typ != nfsTypeDir {
		return nil, fmt.Errorf("NFS target: %s is not a directory", name)
	}
	return fh, nil
}

// Put implements Target.
func (t *NFSTarget) Put(ctx context.Context, key string, data []byte) error {
	dir, name, err := splitKey(key)
	if err != nil {
		return err
	}
	s, err := t.session(ctx)
	if err != nil {
		return err
	}
	return t.check(s, s.put(ctx, dir, name, data))
}

func (s *nfsSession) put(ctx context.Context, dir []string, name string, data []byte) (err error) {
	dfh, err := s.dir(ctx, dir, true)
	if err != nil {
		return err
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := tempPrefix + hex.EncodeToString(rnd[:])
	fh, err := s.pool.create(ctx, dfh, tmp)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil { // best effort: List never shows temporary files
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			_ = s.pool.remove(rctx, dfh, tmp)
		}
	}()
	for off := 0; off < len(data); {
		n, err := s.pool.write(ctx, fh, uint64(off), data[off:min(len(data), off+s.wtmax)])
		if err != nil {
			return err
		}
		off += n
	}
	return s.pool.rename(ctx, dfh, tmp, name)
}

// Get implements Target.
func (t *NFSTarget) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	dir, name, err := splitKey(key)
	if err != nil {
		return nil, err
	}
	s, err := t.session(ctx)
	if err != nil {
		return nil, err
	}
	dfh, err := s.dir(ctx, dir, false)
	if err != nil {
		return nil, t.check(s, err)
	}
	fh, attr, err := s.pool.lookup(ctx, dfh, name)
	if err != nil {
		return nil, t.check(s, err)
	}
	if attr.typ != nfsTypeReg {
		return nil, fmt.Errorf("NFS target: %s is not a regular file", key)
	}
	return &nfsReader{ctx: ctx, t: t, s: s, fh: fh}, nil
}

// nfsReader reads a file with READ calls under the context Get was given.
type nfsReader struct {
	ctx context.Context
	t   *NFSTarget
	s   *nfsSession
	fh  []byte
	off uint64
	eof bool
}

func (r *nfsReader) Read(p []byte) (int, error) {
	if r.eof {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	data, eof, err := r.s.pool.read(r.ctx, r.fh, r.off, min(len(p), r.s.rtmax))
	if err != nil {
		return 0, r.t.check(r.s, err)
	}
	if len(data) == 0 && !eof {
		return 0, Transient(fmt.Errorf("NFS READ: %w: no data before the end", io.ErrUnexpectedEOF))
	}
	n := copy(p, data)
	r.off += uint64(n)
	r.eof = eof
	if eof && n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

func (r *nfsReader) Close() error { return nil }

// Delete implements Target.
func (t *NFSTarget) Delete(ctx context.Context, key string) error {
	dir, name, err := splitKey(key)
	if err != nil {
		return err
	}
	s, err := t.session(ctx)
	if err != nil {
		return err
	}
	dfh, err := s.dir(ctx, dir, false)
	if err == nil {
		err = s.pool.remove(ctx, dfh, name)
	}
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	return t.check(s, err)
}

// List implements Target. It walks only the directory the prefix names
// (its part up to the last "/").
func (t *NFSTarget) List(ctx context.Context, prefix string, fn func(Object) error) error {
	base := prefix[:strings.LastIndex(prefix, "/")+1]
	elems, err := splitPath(base)
	if err != nil {
		return err
	}
	s, err := t.session(ctx)
	if err != nil {
		return err
	}
	dfh, err := s.dir(ctx, elems, false)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return t.check(s, err)
	}
	return t.check(s, s.walk(ctx, dfh, base, prefix, 0, fn))
}

// walk lists directory dfh, whose keys start with base, calling fn for
// the files whose keys start with prefix and descending into directories
// that may hold such keys.
func (s *nfsSession) walk(ctx context.Context, dfh []byte, base, prefix string, depth int, fn func(Object) error) error {
	if depth > nfsMaxDepth {
		return fmt.Errorf("NFS target: directories nested deeper than %d under %q", nfsMaxDepth, base)
	}
	var cookie uint64
	var verf [8]byte
	for {
		ents, next, nextVerf, eof, err := s.pool.readdirplus(ctx, dfh, cookie, verf)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := s.visit(ctx, dfh, e, base, prefix, depth, fn); err != nil {
				return err
			}
		}
		if eof {
			return nil
		}
		if next == cookie {
			// A server whose cookie does not advance would have the
			// listing go round for good.
			return fmt.Errorf("%w: READDIRPLUS cookie did not advance past %d in %q", errRPCMalformed, cookie, base)
		}
		cookie, verf = next, nextVerf
	}
}

// visit handles one directory entry of walk.
func (s *nfsSession) visit(ctx context.Context, dfh []byte, e nfsEntry, base, prefix string, depth int, fn func(Object) error) error {
	if e.name == "." || e.name == ".." || strings.HasPrefix(e.name, tempPrefix) {
		return nil
	}
	if e.name == "" || strings.ContainsAny(e.name, "/\x00") {
		return fmt.Errorf("NFS target: server listed a bad name %q in %q", e.name, base)
	}
	key := base + e.name
	if !strings.HasPrefix(key, prefix) && !strings.HasPrefix(prefix, key+"/") {
		return nil
	}
	if !e.hasAttr || e.fh == nil {
		fh, attr, err := s.pool.lookup(ctx, dfh, e.name)
		if errors.Is(err, ErrNotFound) {
			return nil // deleted while we listed
		}
		if err != nil {
			return err
		}
		e.fh, e.attr = fh, attr
	}
	switch e.attr.typ {
	case nfsTypeDir:
		return s.walk(ctx, e.fh, key+"/", prefix, depth+1, fn)
	case nfsTypeReg:
		if !strings.HasPrefix(key, prefix) {
			return nil
		}
		return fn(Object{Key: key, Size: int64(min(e.attr.size, 1<<62)), ModTime: e.attr.mtime})
	}
	return nil
}
