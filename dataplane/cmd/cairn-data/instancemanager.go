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
		return 0, 0, fmt.Errorf("%q: use A-B, e.g. 10000-11999", s)
	}
	return lo, hi, nil
}

// imFlags is an instance manager's command line, parsed and checked.
type imFlags struct {
	listen, node, binary     string
	logDir, stateDir, runDir string
	host                     string // the children's address (--process-host, or --listen's host)
	dataDirs                 []string
	env                      []string // the children's environment
	portMin, portMax         int
	startTimeout, grace      time.Duration
	insecure                 bool
	serverOpts               []grpc.ServerOption // TLS, when the files are given
	childArgs                []string            // the TLS flags the children get
}

// imRaw holds the flags that parseIMFlags checks and resolves into imFlags.
type imRaw struct {
	portRange, processHost string
	childEnv               stringList
	files                  tlsfiles.Files
	dataTLS                bool
}

// parseIMFlags parses and checks the command line; with a nil result the
// command exits with the code.
func parseIMFlags(args []string, stderr io.Writer) (*imFlags, int) {
	c, raw := &imFlags{}, &imRaw{}
	fs := flag.NewFlagSet("cairn-data instance-manager", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.listen, "listen", "", "host:port for the gRPC API (required)")
	fs.StringVar(&c.node, "node", "", "this node's name (required)")
	var dataDirs stringList
	fs.Var(&dataDirs, "data-dir", "a data directory replicas may use; repeat for each (reported by NodeInfo; every replica's directory must be inside one)")
	fs.StringVar(&raw.portRange, "port-range", "10000-11999", "ports handed to engine and replica processes, A-B")
	fs.StringVar(&c.logDir, "log-dir", "", "directory for process logs (required)")
	fs.StringVar(&c.stateDir, "state-dir", "", "directory recording children, to kill leftovers after a restart (default: --log-dir)")
	fs.StringVar(&c.runDir, "run-dir", "", "directory for the children's unix sockets and FUSE mounts (default: STATE_DIR/run)")
	fs.StringVar(&raw.processHost, "process-host", "", "address the children listen on and report, as other nodes reach this one (default: the host of --listen)")
	fs.Var(&raw.childEnv, "child-env", "KEY=VALUE in the children's environment, which is otherwise only PATH; repeat for each")
	fs.StringVar(&c.binary, "binary", "", "cairn-data binary the children run (default: this one)")
	fs.DurationVar(&c.startTimeout, "start-timeout", 60*time.Second, "a process that has not reported ready by then is killed and put in error")
	fs.DurationVar(&c.grace, "stop-grace", 60*time.Second, "time a process has to exit after SIGTERM before SIGKILL (an engine always gets at least 45s: its final flush)")
	fs.StringVar(&raw.files.Cert, "tls-cert", "", "server certificate (PEM); with --tls-key and --tls-client-ca enables mutual TLS")
	fs.StringVar(&raw.files.Key, "tls-key", "", "server private key (PEM)")
	fs.StringVar(&raw.files.CA, "tls-client-ca", "", "CA (PEM) that signs the client certificates to accept")
	fs.BoolVar(&raw.dataTLS, "data-tls", false, "replicas serve their data ports with TLS and engines use it (with the --tls-* files): volume traffic is encrypted on the network, at a CPU cost (docs/security.md)")
	fs.BoolVar(&c.insecure, "insecure", false, "serve without TLS on a non-loopback address, and start processes without a volume key there (anyone who reaches the ports can run processes and read or write data: tests only)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data instance-manager --listen HOST:PORT --node NAME --data-dir DIR... --port-range A-B --log-dir DIR [--process-host HOST] [--tls-cert F --tls-key F --tls-client-ca F [--data-tls]]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, 2
	}
	if c.listen == "" || c.node == "" || c.logDir == "" {
		fs.Usage()
		return nil, 2
	}
	c.dataDirs = dataDirs
	if err := c.resolve(raw, stderr); err != nil {
		fmt.Fprintf(stderr, "cairn-data instance-manager: %v\n", err)
		return nil, 1
	}
	return c, 0
}

// resolve checks the flags raw holds and sets what they give: the port
// range, TLS, absolute data directories, the children's environment and
// their host.
func (c *imFlags) resolve(raw *imRaw, stderr io.Writer) error {
	var err error
	if c.portMin, c.portMax, err = parsePortRange(raw.portRange); err != nil {
		return fmt.Errorf("--port-range %w", err)
	}
	if err := c.resolveTLS(raw.files, raw.dataTLS, stderr); err != nil {
		return err
	}
	for i, d := range c.dataDirs {
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			return fmt.Errorf("--data-dir %s: not a directory", d)
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return fmt.Errorf("--data-dir %s: %w", d, err)
		}
		c.dataDirs[i] = abs
	}
	c.env = slices.Clone(instancemanager.DefaultEnv)
	for _, kv := range raw.childEnv {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return fmt.Errorf("--child-env %q: use KEY=VALUE", kv)
		}
		c.env = append(c.env, kv)
	}
	c.host = raw.processHost
	if c.host == "" {
		h, _, err := net.SplitHostPort(c.listen)
		if err != nil {
			return fmt.Errorf("--listen %s: %w", c.listen, err)
		}
		c.host = h
	}
	if ip := net.ParseIP(c.host); c.host == "" || (ip != nil && ip.IsUnspecified()) {
		return fmt.Errorf("--process-host: give the address other nodes reach this node on (--listen %s does not name one)", c.listen)
	}
	return nil
}

// resolveTLS sets the server's TLS and the children's TLS flags from the
// files, or refuses to serve a non-loopback address without them (unless
// --insecure).
func (c *imFlags) resolveTLS(files tlsfiles.Files, dataTLS bool, stderr io.Writer) error {
	switch err := files.Check(); {
	case err != nil:
		return err
	case files.Set():
		src, err := tlsfiles.New(files, newLogger(stderr, "instance-manager"))
		if err != nil {
			return err
		}
		c.serverOpts = append(c.serverOpts, grpc.Creds(credentials.NewTLS(src.Server())))
		// The engines and replicas serve their control ports with the same
		// files, and the engines use them as clients of the replicas.
		for i, f := range []*string{&files.Cert, &files.Key, &files.CA} {
			abs, err := filepath.Abs(*f)
			if err != nil {
				return fmt.Errorf("TLS file %d: %w", i, err)
			}
			*f = abs
		}
		c.childArgs = files.Args()
		if dataTLS {
			c.childArgs = append(c.childArgs, "--data-tls")
		}
	case dataTLS:
		return errors.New("--data-tls needs --tls-cert, --tls-key and --tls-client-ca")
	case !isLoopback(c.listen) && !c.insecure:
		return fmt.Errorf("refusing to serve without TLS on %s: anyone who can reach it could run processes on this node. "+
			"Give --tls-cert, --tls-key and --tls-client-ca (see docs/security.md), listen on loopback, or pass --insecure for a test setup", c.listen)
	}
	return nil
}

func runInstanceManager(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	c, code := parseIMFlags(args, stderr)
	if c == nil {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "cairn-data instance-manager: "+format+"\n", a...)
		return 1
	}
	log := newLogger(stderr, "instance-manager")
	sup, err := instancemanager.New(instancemanager.Options{Binary: c.binary, PortMin: c.portMin, PortMax: c.portMax, LogDir: c.logDir,
		StateDir: c.stateDir, RunDir: c.runDir, Host: c.host, DataDirs: c.dataDirs, Env: c.env, StartTimeout: c.startTimeout, StopGrace: c.grace, Logger: log,
		// Children on a network address serve data only to holders of
		// their volume's key (--insecure and loopback test setups aside).
		RequireAuthKey: !c.insecure && !isLoopback(net.JoinHostPort(c.host, "0")), ChildArgs: c.childArgs})
	if err != nil {
		return fail("%v", err)
	}
	l, err := listen("--listen", c.listen)
	if err != nil {
		sup.Close()
		return fail("%v", err)
	}
	gs := grpc.NewServer(append(c.serverOpts, grpcalive.Serve())...)
	imv1.RegisterInstanceManagerServiceServer(gs, &imserver.Server{S: sup, NodeName: c.node, Version: dataplane.Version, DataDirs: c.dataDirs})
	serveErr := make(chan error, 1)
	go func() { serveErr <- gs.Serve(l) }()
	fmt.Fprintf(stdout, "ready control=%s node=%s\n", l.Addr(), c.node)
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
