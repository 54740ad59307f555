package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
)

func newLogger(w io.Writer, name string) logr.Logger {
	return funcr.New(func(prefix, args string) {
		fmt.Fprintf(w, "%s %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), prefix, args)
	}, funcr.Options{}).WithName(name)
}

// listen opens a TCP listener with an error that says what to do.
func listen(flagName, addr string) (net.Listener, error) {
	l, err := net.Listen("tcp", addr)
	if errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("%s %s: the port is already in use; stop what holds it or choose another port", flagName, addr)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", flagName, addr, err)
	}
	return l, nil
}

func runReplica(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data replica", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "replica directory; created with an empty replica if it does not exist (required)")
	sizeFlag := fs.String("size", "", "volume size, e.g. 10Gi; required to create a replica, must match an existing one")
	listenAddr := fs.String("listen", "", "host:port to serve data on (dataconn) (required; port 0 picks one)")
	controlAddr := fs.String("control-listen", "", "host:port to serve the gRPC control API on (default: none)")
	workers := fs.Int("workers", 0, "concurrent I/O requests against the disk (default 4 x CPUs)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data replica --dir DIR --size SIZE --listen HOST:PORT [--control-listen HOST:PORT]")
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
	log := newLogger(stderr, "replica")
	r, err := replica.Open(*dir, replica.Options{Size: size, Logger: log})
	if err != nil {
		return fail("%v", err)
	}
	closeReplica := func() {
		if err := r.Flush(); err != nil && !errors.Is(err, replica.ErrClosed) {
			log.Error(err, "final flush failed")
		}
		if err := r.Close(); err != nil {
			log.Error(err, "close failed")
		}
	}
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
		controlShown = cl.Addr().String()
	}
	run := replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl, Workers: *workers, Logger: log})
	fmt.Fprintf(stdout, "ready data=%s control=%s size=%d\n", dl.Addr(), controlShown, r.Size())
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
