package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/cairn-io/cairn/dataplane"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
	"github.com/cairn-io/cairn/dataplane/instancemanager"
	"github.com/cairn-io/cairn/dataplane/instancemanager/imserver"
	"github.com/cairn-io/cairn/dataplane/internal/tlsfiles"
)

func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func parsePortRange(s string) (int, int, error) {
	a, b, ok := strings.Cut(s, "-")
	lo, err1 := strconv.Atoi(a)
	hi, err2 := strconv.Atoi(b)
	if !ok || err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("%q: use A-B, e.g. 10000-10999", s)
	}
	return lo, hi, nil
}

func runInstanceManager(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data instance-manager", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listenAddr := fs.String("listen", "", "host:port for the gRPC API (required)")
	node := fs.String("node", "", "this node's name (required)")
	var dataDirs stringList
	fs.Var(&dataDirs, "data-dir", "a data directory replicas may use; repeat for each (reported by NodeInfo; every replica's directory must be inside one)")
	portRange := fs.String("port-range", "10000-10999", "ports handed to engine and replica processes, A-B")
	logDir := fs.String("log-dir", "", "directory for process logs (required)")
	stateDir := fs.String("state-dir", "", "directory recording children, to kill leftovers after a restart (default: --log-dir)")
	runDir := fs.String("run-dir", "", "directory for the children's unix sockets and FUSE mounts (default: STATE_DIR/run)")
	processHost := fs.String("process-host", "", "address the children listen on and report, as other nodes reach this one (default: the host of --listen)")
	var childEnv stringList
	fs.Var(&childEnv, "child-env", "KEY=VALUE in the children's environment, which is otherwise only PATH; repeat for each")
	binary := fs.String("binary", "", "cairn-data binary the children run (default: this one)")
	startTimeout := fs.Duration("start-timeout", 60*time.Second, "a process that has not reported ready by then is killed and put in error")
	grace := fs.Duration("stop-grace", 60*time.Second, "time a process has to exit after SIGTERM before SIGKILL (an engine always gets at least 45s: its final flush)")
	certFile := fs.String("tls-cert", "", "server certificate (PEM); with --tls-key and --tls-client-ca enables mutual TLS")
	keyFile := fs.String("tls-key", "", "server private key (PEM)")
	caFile := fs.String("tls-client-ca", "", "CA (PEM) that signs the client certificates to accept")
	dataTLS := fs.Bool("data-tls", false, "replicas serve their data ports with TLS and engines use it (with the --tls-* files): volume traffic is encrypted on the network, at a CPU cost (docs/security.md)")
	insecure := fs.Bool("insecure", false, "serve without TLS on a non-loopback address, and start processes without a volume key there (anyone who reaches the ports can run processes and read or write data: tests only)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data instance-manager --listen HOST:PORT --node NAME --data-dir DIR... --port-range A-B --log-dir DIR [--process-host HOST] [--tls-cert F --tls-key F --tls-client-ca F [--data-tls]]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "cairn-data instance-manager: "+format+"\n", a...)
		return 1
	}
	if *listenAddr == "" || *node == "" || *logDir == "" {
		fs.Usage()
		return 2
	}
	lo, hi, err := parsePortRange(*portRange)
	if err != nil {
		return fail("--port-range %v", err)
	}
	var opts []grpc.ServerOption
	files := tlsfiles.Files{Cert: *certFile, Key: *keyFile, CA: *caFile}
	var childArgs []string
	switch err := files.Check(); {
	case err != nil:
		return fail("%v", err)
	case files.Set():
		src, err := tlsfiles.New(files, newLogger(stderr, "instance-manager"))
		if err != nil {
			return fail("%v", err)
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(src.Server())))
		// The engines and replicas serve their control ports with the same
		// files, and the engines use them as clients of the replicas.
		for i, f := range []*string{&files.Cert, &files.Key, &files.CA} {
			abs, err := filepath.Abs(*f)
			if err != nil {
				return fail("TLS file %d: %v", i, err)
			}
			*f = abs
		}
		childArgs = files.Args()
		if *dataTLS {
			childArgs = append(childArgs, "--data-tls")
		}
	case *dataTLS:
		return fail("--data-tls needs --tls-cert, --tls-key and --tls-client-ca")
	case !isLoopback(*listenAddr) && !*insecure:
		return fail("refusing to serve without TLS on %s: anyone who can reach it could run processes on this node. "+
			"Give --tls-cert, --tls-key and --tls-client-ca (see docs/security.md), listen on loopback, or pass --insecure for a test setup", *listenAddr)
	}
	for i, d := range dataDirs {
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			return fail("--data-dir %s: not a directory", d)
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return fail("--data-dir %s: %v", d, err)
		}
		dataDirs[i] = abs
	}
	env := slices.Clone(instancemanager.DefaultEnv)
	for _, kv := range childEnv {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fail("--child-env %q: use KEY=VALUE", kv)
		}
		env = append(env, kv)
	}
	host := *processHost
	if host == "" {
		h, _, err := net.SplitHostPort(*listenAddr)
		if err != nil {
			return fail("--listen %s: %v", *listenAddr, err)
		}
		host = h
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return fail("--process-host: give the address other nodes reach this node on (--listen %s does not name one)", *listenAddr)
	}
	log := newLogger(stderr, "instance-manager")
	sup, err := instancemanager.New(instancemanager.Options{Binary: *binary, PortMin: lo, PortMax: hi, LogDir: *logDir,
		StateDir: *stateDir, RunDir: *runDir, Host: host, DataDirs: dataDirs, Env: env, StartTimeout: *startTimeout, StopGrace: *grace, Logger: log,
		// Children on a network address serve data only to holders of
		// their volume's key (--insecure and loopback test setups aside).
		RequireAuthKey: !*insecure && !isLoopback(net.JoinHostPort(host, "0")), ChildArgs: childArgs})
	if err != nil {
		return fail("%v", err)
	}
	l, err := listen("--listen", *listenAddr)
	if err != nil {
		sup.Close()
		return fail("%v", err)
	}
	gs := grpc.NewServer(append(opts, grpcalive.Serve())...)
	imv1.RegisterInstanceManagerServiceServer(gs, &imserver.Server{S: sup, NodeName: *node, Version: dataplane.Version, DataDirs: dataDirs})
	serveErr := make(chan error, 1)
	go func() { serveErr <- gs.Serve(l) }()
	fmt.Fprintf(stdout, "ready control=%s node=%s\n", l.Addr(), *node)
	select {
	case <-ctx.Done():
	case err := <-serveErr:
		if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			log.Error(err, "gRPC server failed")
		}
	}
	log.Info("stopping: engines first, then replicas")
	sup.Close()
	gs.Stop()
	log.Info("stopped")
	return 0
}
