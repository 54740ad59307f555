// Package nfsserver runs the NFS server the backup tests use: go-nfs, a
// user-space NFSv3 server, serving a directory on 127.0.0.1 with the MOUNT
// and NFS services on one TCP port (no portmapper).
package nfsserver

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"

	"github.com/go-git/go-billy/v5"
	"github.com/go-git/go-billy/v5/osfs"
	nfs "github.com/willscott/go-nfs"
	nfshelper "github.com/willscott/go-nfs/helpers"
)

// Options configures a server.
type Options struct {
	// Dir is the directory served; it must exist.
	Dir string
	// Export is the path clients mount; a MOUNT of any other path fails
	// with MNT3ERR_NOENT. Empty means "/export".
	Export string
	// Addr is where to listen; empty means a free port of 127.0.0.1.
	Addr string
	// Refuse makes every MOUNT fail with MNT3ERR_ACCES, as a server whose
	// export does not list the client does.
	Refuse bool
}

// Server is a running server.
type Server struct {
	// Host and Port are where the MOUNT and NFS services listen.
	Host string
	Port int
	// Export is the path to mount.
	Export string

	l    *trackingListener
	done chan error
	err  error
}

// trackingListener remembers the connections it accepted, so Stop can
// close them: go-nfs serves an accepted connection until the client
// closes it.
type trackingListener struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
	open  atomic.Int64
}

func (l *trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, open: &l.open}
	l.open.Add(1)
	l.mu.Lock()
	l.conns = append(l.conns, tc)
	l.mu.Unlock()
	return tc, nil
}

// trackedConn counts itself out of the listener's open connections
// when closed (go-nfs closes a connection once its client has).
type trackedConn struct {
	net.Conn
	open *atomic.Int64
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() { c.open.Add(-1) })
	return c.Conn.Close()
}

func (l *trackingListener) closeAll() {
	_ = l.Close()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		_ = c.Close()
	}
}

// Start serves opts.Dir.
func Start(opts Options) (*Server, error) {
	if st, err := os.Stat(opts.Dir); err != nil || !st.IsDir() {
		return nil, errors.New("nfsserver: Dir must be an existing directory")
	}
	if opts.Export == "" {
		opts.Export = "/export"
	}
	if opts.Addr == "" {
		opts.Addr = "127.0.0.1:0"
	}
	nl, err := net.Listen("tcp", opts.Addr)
	if err != nil {
		return nil, err
	}
	l := &trackingListener{Listener: nl}
	nfs.Log.SetLevel(nfs.ErrorLevel)
	bfs := osfs.New(opts.Dir)
	h := &exportHandler{Handler: nfshelper.NewNullAuthHandler(bfs), fs: bfs, opts: opts}
	// A handle cache far larger than any test's file count: an evicted
	// handle would read as stale.
	cached := nfshelper.NewCachingHandler(h, 1<<20)
	addr := l.Addr().(*net.TCPAddr)
	s := &Server{Host: addr.IP.String(), Port: addr.Port, Export: opts.Export, l: l, done: make(chan error, 1)}
	go func() { s.done <- nfs.Serve(l, cached) }()
	return s, nil
}

// Stop closes the listener and every connection, as a server that went
// away would, and waits for the server to return. The server forgets
// its file handles: a client that used them gets NFS3ERR_STALE from the
// next server on the directory.
func (s *Server) Stop() {
	s.l.closeAll()
	if err := <-s.done; err != nil && !errors.Is(err, net.ErrClosed) {
		s.err = err
	}
}

// OpenConns is how many client connections the server holds: accepted
// and not yet closed by the client (or by Stop).
func (s *Server) OpenConns() int { return int(s.l.open.Load()) }

// Err is the error the server stopped with, other than its closed
// listener's (nil until Stop).
func (s *Server) Err() error { return s.err }

// exportHandler answers MOUNT requests for one export path only.
type exportHandler struct {
	nfs.Handler
	fs   billy.Filesystem
	opts Options
}

// Mount refuses or answers as opts say. A refusal still returns the
// filesystem: go-nfs makes a root handle of it whatever the status, and
// sends it only with MNT3_OK.

func (h *exportHandler) Mount(ctx context.Context, c net.Conn, req nfs.MountRequest) (nfs.MountStatus, billy.Filesystem, []nfs.AuthFlavor) {
	if h.opts.Refuse {
		return nfs.MountStatusErrAcces, h.fs, nil
	}
	if string(req.Dirpath) != h.opts.Export {
		return nfs.MountStatusErrNoEnt, h.fs, nil
	}
	return h.Handler.Mount(ctx, c, req)
}
