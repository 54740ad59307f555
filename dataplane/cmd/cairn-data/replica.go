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
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/dataconn"
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

func runReplica(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data replica", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "replica directory; created with an empty replica if it does not exist (required)")
	sizeFlag := fs.String("size", "", "volume size, e.g. 10Gi; required to create a replica, must match an existing one")
	listenAddr := fs.String("listen", "", "host:port to serve data on (dataconn), or unix:PATH for a unix socket that an engine on the same node reaches with less overhead (required; port 0 picks one)")
	controlAddr := fs.String("control-listen", "", "host:port to serve the gRPC control API on (default: none)")
	direct := fs.Bool("direct-io", false, "read and write the data files with O_DIRECT, bypassing this node's page cache")
	workers := fs.Int("workers", 0, "concurrent I/O requests against the disk (default 4 x CPUs)")
	readyFD := fs.Int("ready-fd", -1, "once serving, write the ready report (JSON: addresses, size) to this descriptor and close it (the instance manager's contract)")
	var files tlsfiles.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "certificate (PEM) the control API serves with; with --tls-key and --tls-client-ca the control API requires a client certificate of that CA")
	fs.StringVar(&files.Key, "tls-key", "", "its private key (PEM)")
	fs.StringVar(&files.CA, "tls-client-ca", "", "CA bundle (PEM) the clients' certificates must chain to")
	dataTLS := fs.Bool("data-tls", false, "serve the data port (a TCP --listen) with TLS too, with the --tls-* files, requiring a client certificate of that CA: the volume's traffic is encrypted on the network (an engine with --data-tls)")
	keyFD := fs.Int("auth-key-fd", -1, "read the volume's key (32 bytes) from this inherited descriptor; data connections must then prove they hold it (-1: none, anyone who reaches --listen is served)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data replica --dir DIR --size SIZE --listen HOST:PORT|unix:PATH [--control-listen HOST:PORT] [--direct-io]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "cairn-data replica: "+format+"\n", a...)
		return 1
	}
	if *dir == "" || *listenAddr == "" {
		fs.Usage()
		return 2
	}
	var size int64
	if *sizeFlag != "" {
		var err error
		if size, err = parseSize(*sizeFlag); err != nil {
			return fail("--size: %v", err)
		}
	}
	key, err := readKey(*keyFD)
	if err != nil {
		return fail("%v", err)
	}
	if err := files.Check(); err != nil {
		return fail("%v", err)
	}
	var controlTLS, dataServerTLS *tls.Config
	if files.Set() {
		src, err := tlsfiles.New(files, newLogger(stderr, "replica"))
		if err != nil {
			return fail("%v", err)
		}
		controlTLS = src.Server()
		if *dataTLS && !strings.HasPrefix(*listenAddr, "unix:") {
			dataServerTLS = src.Server()
		}
	} else if *dataTLS {
		return fail("--data-tls needs --tls-cert, --tls-key and --tls-client-ca")
	}
	log := newLogger(stderr, "replica")
	r, err := replica.Open(*dir, replica.Options{Size: size, Logger: log, DirectIO: *direct})
	if err != nil {
		return fail("%v", err)
	}
	if *direct {
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
	// The data listener opens before the control one: an instance manager
	// that sees the control port accept (its readiness check) knows a
	// unix-socket data listener, which it did not allocate, is up too.
	dl, err := listen("--listen", *listenAddr)
	if err != nil {
		closeReplica()
		return fail("%v", err)
	}
	var cl net.Listener
	controlShown := "none"
	if *controlAddr != "" {
		if cl, err = listen("--control-listen", *controlAddr); err != nil {
			dl.Close()
			closeReplica()
			return fail("%v", err)
		}
		controlShown = addrString(cl)
	}
	run := replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl, Workers: *workers, Key: key, ControlTLS: controlTLS, DataTLS: dataServerTLS, Logger: log})
	fmt.Fprintf(stdout, "ready data=%s control=%s size=%d\n", addrString(dl), controlShown, r.Size())
	rep := ready.Report{Data: addrString(dl), Size: r.Size()}
	if cl != nil {
		rep.Control = addrString(cl)
	}
	if err := ready.Write(*readyFD, rep); err != nil {
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
