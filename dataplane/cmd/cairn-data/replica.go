package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/internal/idlemem"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/internal/tlsfiles"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
)

func newLogger(w io.Writer, name string) logr.Logger {
	return funcr.New(func(prefix, args string) {
		fmt.Fprintf(w, "%s %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), prefix, args)
	}, funcr.Options{}).WithName(name)
}

// listen opens a TCP listener, or a unix socket for "unix:PATH", with an
// error that says what to do.
func listen(flagName, addr string) (net.Listener, error) {
	network, address := dataconn.SplitNetwork(addr)
	if network == "unix" {
		return listenUnix(flagName, address)
	}
	l, err := net.Listen(network, address)
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("%s %s: the port is already in use; stop what holds it or choose another port", flagName, addr)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", flagName, addr, err)
	}
	return l, nil
}

// listenUnix listens on the unix socket path. A socket left there by a
// process that died is replaced; one that still answers is refused rather
// than stolen.
func listenUnix(flagName, path string) (net.Listener, error) {
	if fi, err := os.Stat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		if c, err := net.Dial("unix", path); err == nil {
			c.Close()
			return nil, fmt.Errorf("%s %s: another server is listening on it; stop it or choose another path", flagName, path)
		}
		os.Remove(path)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", flagName, path, err)
	}
	// Only this user (root on a node) may connect: the socket carries data.
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("%s %s: %w", flagName, path, err)
	}
	return l, nil
}

// addrString is a listener's address as the engine's --replica flag takes it.
func addrString(l net.Listener) string {
	if l.Addr().Network() == "unix" {
		return "unix:" + l.Addr().String()
	}
	return l.Addr().String()
}

// replicaFlags is a replica's command line, parsed and checked.
type replicaFlags struct {
	dir, listen, control string
	local                string // --listen-local: unix:PATH, or ""
	size                 int64  // 0: an existing replica's
	direct               bool
	workers              int
	readyFD              int
	clearDelay           time.Duration
	key                  []byte
	controlTLS, dataTLS  *tls.Config // nil: plain
	// sourceTLS is the client side of controlTLS: what the replica's
	// pulls of rebuild data from other replicas connect with.
	sourceTLS *tls.Config
}

// replicaFail prints a replica's fatal error and returns its exit code.
func replicaFail(stderr io.Writer, format string, a ...any) int {
	fmt.Fprintf(stderr, "cairn-data replica: "+format+"\n", a...)
	return 1
}

// parseReplicaFlags parses and checks the command line, reads the volume's
// key and loads the TLS files; with a nil result the command exits with
// the code.
func parseReplicaFlags(args []string, stderr io.Writer) (*replicaFlags, int) {
	c := &replicaFlags{}
	fs := flag.NewFlagSet("cairn-data replica", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.dir, "dir", "", "replica directory; created with an empty replica if it does not exist (required)")
	sizeFlag := fs.String("size", "", "volume size, e.g. 10Gi; required to create a replica, must match an existing one")
	fs.StringVar(&c.listen, "listen", "", "host:port to serve data on (dataconn), or unix:PATH for a unix socket that an engine on the same node reaches with less overhead (required; port 0 picks one)")
	fs.StringVar(&c.local, "listen-local", "", "unix:PATH of a second data listener beside a TCP --listen, for an engine on the same node (it reaches the replica there with shared memory; engines elsewhere, rebuilds and backups use --listen); served without TLS (default: none)")
	fs.StringVar(&c.control, "control-listen", "", "host:port to serve the gRPC control API on (default: none)")
	fs.BoolVar(&c.direct, "direct-io", false, "read and write the data files with O_DIRECT, bypassing this node's page cache")
	fs.IntVar(&c.workers, "workers", 0, "concurrent I/O requests against the disk (default 4 x CPUs)")
	fs.DurationVar(&c.clearDelay, "dirty-clear-delay", replica.DefaultClearDelay, "how long a region must go unwritten before a flush may clear its write-intent bit (the engine flushes an idle volume by itself, see its --idle-flush)")
	fs.IntVar(&c.readyFD, "ready-fd", -1, "once serving, write the ready report (JSON: addresses, size) to this descriptor and close it (the instance manager's contract)")
	var files tlsfiles.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "certificate (PEM) the control API serves with, and presents to the other replicas' control APIs it pulls rebuild data from; with --tls-key and --tls-client-ca the control API requires a client certificate of that CA")
	fs.StringVar(&files.Key, "tls-key", "", "its private key (PEM)")
	fs.StringVar(&files.CA, "tls-client-ca", "", "CA bundle (PEM) the clients' certificates must chain to")
	dataTLS := fs.Bool("data-tls", false, "serve the data port (a TCP --listen, not a unix socket nor --listen-local) with TLS too, with the --tls-* files, requiring a client certificate of that CA: the volume's traffic is encrypted on the network (an engine with --data-tls)")
	keyFD := fs.Int("auth-key-fd", -1, "read the volume's key (32 bytes) from this inherited descriptor; data connections must then prove they hold it (-1: none, anyone who reaches a data listener is served)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data replica --dir DIR --size SIZE --listen HOST:PORT|unix:PATH [--listen-local unix:PATH] [--control-listen HOST:PORT] [--direct-io]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, 2
	}
	if c.dir == "" || c.listen == "" {
		fs.Usage()
		return nil, 2
	}
	if err := checkListenLocal(c.listen, c.local); err != nil {
		return nil, replicaFail(stderr, "%v", err)
	}
	if c.clearDelay <= 0 {
		return nil, replicaFail(stderr, "--dirty-clear-delay must be positive, got %v", c.clearDelay)
	}
	if *sizeFlag != "" {
		var err error
		if c.size, err = parseSize(*sizeFlag); err != nil {
			return nil, replicaFail(stderr, "--size: %v", err)
		}
	}
	var err error
	if c.key, err = readKey(*keyFD); err != nil {
		return nil, replicaFail(stderr, "%v", err)
	}
	if err := files.Check(); err != nil {
		return nil, replicaFail(stderr, "%v", err)
	}
	if files.Set() {
		src, err := tlsfiles.New(files, newLogger(stderr, "replica"))
		if err != nil {
			return nil, replicaFail(stderr, "%v", err)
		}
		c.controlTLS, c.sourceTLS = src.Server(), src.Client()
		if *dataTLS { // the data server applies it to a TCP --listen only
			c.dataTLS = src.Server()
		}
	} else if *dataTLS {
		return nil, replicaFail(stderr, "--data-tls needs --tls-cert, --tls-key and --tls-client-ca")
	}
	return c, 0
}

// checkListenLocal checks --listen-local (local, "" when not given)
// against --listen: a unix socket beside a TCP data port.
func checkListenLocal(listen, local string) error {
	if local == "" {
		return nil
	}
	if network, path := dataconn.SplitNetwork(local); network != "unix" || path == "" {
		return fmt.Errorf("--listen-local %s: give unix:PATH, a unix socket for an engine on this node (the TCP data port is --listen)", local)
	}
	if network, _ := dataconn.SplitNetwork(listen); network == "unix" {
		return fmt.Errorf("--listen-local %s: --listen %s is already a unix socket; --listen-local adds one beside a TCP --listen", local, listen)
	}
	return nil
}

func runReplica(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c, code := parseReplicaFlags(args, stderr)
	if c == nil {
		return code
	}
	log := newLogger(stderr, "replica")
	r, err := replica.Open(c.dir, replica.Options{Size: c.size, Logger: log, DirectIO: c.direct, ClearDelay: c.clearDelay})
	if err != nil {
		return replicaFail(stderr, "%v", err)
	}
	if c.direct {
		log.Info("direct I/O", "through", replica.DirectIOPath())
	}
	closeReplica := func() {
		if err := r.Flush(); err != nil && !errors.Is(err, replica.ErrClosed) {
			log.Error(err, "final flush failed")
		}
		if err := r.Close(); err != nil {
			log.Error(err, "close failed")
		}
	}
	ls, err := replicaListeners(c)
	if err != nil {
		closeReplica()
		return replicaFail(stderr, "%v", err)
	}
	dl, ll, cl := ls.data, ls.local, ls.control
	run := replicaserver.Start(r, replicaserver.Options{Data: dl, Local: ll, Control: cl, Workers: c.workers, Key: c.key, ControlTLS: c.controlTLS, SourceTLS: c.sourceTLS, DataTLS: c.dataTLS, Logger: log})
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go idlemem.Watch(wctx, idlemem.Period, idlemem.Release) // an idle replica's spare heap back to the node
	controlShown := "none"
	rep := ready.Report{Data: addrString(dl), Size: r.Size()}
	if cl != nil {
		controlShown = addrString(cl)
		rep.Control = addrString(cl)
	}
	localShown := ""
	if ll != nil {
		rep.LocalData = addrString(ll)
		localShown = " local=" + rep.LocalData
	}
	fmt.Fprintf(stdout, "ready data=%s control=%s size=%d%s\n", addrString(dl), controlShown, r.Size(), localShown)
	if err := ready.Write(c.readyFD, rep); err != nil {
		log.Error(err, "could not report ready")
	}
	select {
	case <-ctx.Done():
	case <-run.Done:
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	run.Shutdown(sctx)
	log.Info("stopped")
	return 0
}

// listeners are a replica's listeners; local and control are nil when
// not asked for.
type listeners struct {
	data, local, control net.Listener
}

// replicaListeners opens the data listener, with --listen-local the local
// one, and with --control-listen the control one. The data listeners open
// first: an instance manager that sees the control port accept (its
// readiness check) knows the unix-socket data listeners, which it did not
// allocate, are up too.
func replicaListeners(c *replicaFlags) (listeners, error) {
	var ls listeners
	closeAll := func() {
		for _, l := range []net.Listener{ls.data, ls.local} {
			if l != nil {
				l.Close()
			}
		}
	}
	var err error
	if ls.data, err = listen("--listen", c.listen); err != nil {
		return listeners{}, err
	}
	if c.local != "" {
		if ls.local, err = listen("--listen-local", c.local); err != nil {
			closeAll()
			return listeners{}, err
		}
	}
	if c.control != "" {
		if ls.control, err = listen("--control-listen", c.control); err != nil {
			closeAll()
			return listeners{}, err
		}
	}
	return ls, nil
}
