package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/engineserver"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/frontend/nbd"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
	"github.com/cairn-io/cairn/dataplane/instancemanager"
	"github.com/cairn-io/cairn/dataplane/internal/idlemem"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
	"github.com/cairn-io/cairn/dataplane/internal/tlsfiles"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// frontend is a started frontend: where it serves and how to stop it.
type frontend struct {
	endpoint string             // the block device, or the NBD socket without one
	kind     ready.EndpointKind // what endpoint is
	socket   string             // the NBD socket (nbd frontend)
	// fallback says why an nbd frontend asked for a kernel device
	// (--nbd-kernel auto) serves only its socket; "" otherwise.
	fallback string
	// resumed: the device is the one a dead engine of the volume served,
	// taken over (its users kept their I/O and mounts).
	resumed bool
	inUse   func() string
	// resize has the block device show the volume's new size after an
	// expansion; nil without a device.
	resize func(ctx context.Context, size int64) error
	// stop detaches the device: the volume is no longer used here.
	stop func()
	// leave stops serving but leaves the device to the next engine of the
	// volume (the instance manager is going away; see
	// instancemanager.HandOverSignal); nil: stop does (the fuse frontend
	// decides itself, leaving its device to the device keeper while it is
	// in use).
	leave func()
}

// engineFlags is what cairn-data engine was asked for.
type engineFlags struct {
	name           string
	size           int64 // 0: the replicas' size
	replicas       stringList
	wanted         int
	frontend       string // nbd or fuse
	sock           string
	nbdKernel      nbd.KernelMode
	reattachWait   time.Duration
	fuseDir        string
	deviceKeeper   string // the device keeper's socket, "" for none
	listen         string
	shared         int64
	replicaTimeout time.Duration
	idleFlush      time.Duration
	connectTimeout time.Duration // bounds each attempt to reach a replica at open
	acceptLost     bool          // serve without members of the newest epoch that were not given
	readyFD        int
	key            []byte
	cipher         *volcrypt.Cipher // encryption at rest, or nil
	tls            *tlsfiles.Source // mutual TLS of the control ports, or nil
	dataTLS        bool             // TLS on the replicas' TCP data ports too
}

// rawEngineFlags are the flags parsed into strings and numbers that
// engineFlags gets only once checked.
type rawEngineFlags struct {
	size, nbdKernel, shared, encCheck *string
	keyFD, encKeyFD                   *int
	files                             tlsfiles.Files
}

// parseEngineFlags parses and checks the command line; with a nil result
// the command exits with the code.
func parseEngineFlags(args []string, stderr io.Writer) (*engineFlags, int) {
	c := &engineFlags{}
	fs := flag.NewFlagSet("cairn-data engine", flag.ContinueOnError)
	fs.SetOutput(stderr)
	r := defineEngineFlags(fs, c)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data engine --name NAME --replica HOST:PORT ... --frontend nbd|fuse [--nbd-socket PATH [--nbd-kernel auto|on|off] | --fuse-dir DIR] [--listen HOST:PORT] [--encryption-key-fd N --encryption-key-check HEX]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, 2
	}
	if c.name == "" || len(c.replicas) == 0 {
		fs.Usage()
		return nil, 2
	}
	if err := r.apply(c, stderr); err != nil {
		fmt.Fprintf(stderr, "cairn-data engine: %v\n", err)
		return nil, 1
	}
	return c, 0
}

// defineEngineFlags declares the engine's flags: those that need no check
// straight into c, the others into the result.
func defineEngineFlags(fs *flag.FlagSet, c *engineFlags) *rawEngineFlags {
	r := &rawEngineFlags{}
	fs.StringVar(&c.name, "name", "", "volume name (required)")
	r.size = fs.String("size", "", "volume size, e.g. 10Gi (default: the replicas' size)")
	fs.Var(&c.replicas, "replica", "replica address HOST:PORT (control on PORT+1) or DATA,CONTROL; repeat for each replica (required)")
	fs.IntVar(&c.wanted, "wanted", 0, "replicas that make the volume healthy (default: the number of --replica)")
	fs.StringVar(&c.frontend, "frontend", "fuse", "how to expose the volume: fuse (a loop device over a FUSE file; works on any node with FUSE and loop, the default here as in a Volume's spec.frontend and the instance manager's spec) or nbd")
	fs.StringVar(&c.sock, "nbd-socket", "", "unix socket path for the nbd frontend")
	r.nbdKernel = fs.String("nbd-kernel", "auto", "attach the nbd frontend to a /dev/nbdN through the kernel's nbd driver: auto (if the host has it), on (required), off (socket only)")
	fs.DurationVar(&c.reattachWait, "nbd-reattach-wait", 2*time.Minute, "if the engine dies, or is stopped with SIGUSR1 (its instance manager going away: the device is left attached, where SIGTERM detaches it), how long the kernel holds /dev/nbdN's I/O for a restarted engine to reattach it (0: fail the I/O at once, and SIGUSR1 detaches as SIGTERM does)")
	fs.StringVar(&c.fuseDir, "fuse-dir", "", "mount directory for the fuse frontend")
	fs.StringVar(&c.deviceKeeper, "device-keeper", os.Getenv("CAIRN_DEVICE_KEEPER"), "the device keeper's socket (cairn-data device-keeper; default $CAIRN_DEVICE_KEEPER): the fuse frontend deposits its device there, and takes over the device a dead engine of the volume left, so a restart pauses the I/O instead of failing it (\"\": none)")
	fs.StringVar(&c.listen, "listen", "", "host:port for the gRPC control API (default: none)")
	r.shared = fs.String("shared-memory", "32Mi", "memory shared with replicas on unix sockets, for the frontend's writes to reach them without a socket copy; 0 turns it off")
	fs.DurationVar(&c.replicaTimeout, "replica-timeout", 8*time.Second, "a replica that does not answer a request in this time is failed")
	fs.DurationVar(&c.idleFlush, "idle-flush", engine.DefaultIdleFlush, "after writes with no flush from the client for this long, flush the replicas (three times, this far apart) so that their write-intent bits clear and a replica back from an outage copies only what was written meanwhile; keep it above the replicas' --dirty-clear-delay; negative: never")
	fs.DurationVar(&c.connectTimeout, "connect-timeout", engine.DefaultConnectTimeout, "at open, how long each attempt to reach a replica (connect, handshake, first answer) may take; the replicas are tried at once, and one that does not answer is left out (ERR) when the others can serve the volume safely, else tried again")
	fs.BoolVar(&c.acceptLost, "accept-lost-members", false, "at open, serve the volume although replicas recorded as RW at its newest epoch are not among the --replica given, once every given one answered: they are declared lost for good (the control plane sets this only when each replica left out is on a node an operator declared shut down); writes only they held are lost. A given replica that does not answer is still waited for")
	fs.StringVar(&r.files.Cert, "tls-cert", "", "certificate (PEM) the control API serves with and presents to the replicas' control APIs; with --tls-key and --tls-client-ca enables mutual TLS on both")
	fs.StringVar(&r.files.Key, "tls-key", "", "its private key (PEM)")
	fs.StringVar(&r.files.CA, "tls-client-ca", "", "CA bundle (PEM) the peers' certificates must chain to")
	fs.BoolVar(&c.dataTLS, "data-tls", false, "connect to the replicas' TCP data ports with TLS too (replicas with --data-tls), presenting the --tls-* certificate: the volume's traffic is encrypted on the network")
	r.keyFD = fs.Int("auth-key-fd", -1, "read the volume's key (32 bytes) from this inherited descriptor and authenticate every data connection to the replicas with it (-1: none)")
	r.encKeyFD = fs.Int("encryption-key-fd", -1, "encrypt the volume at rest (AES-256-XTS): read its key (64 bytes) from this inherited descriptor, which is then closed; every write is encrypted before it reaches the replicas and every read decrypted, so replicas, rebuilds, snapshots and clones hold ciphertext only. Needs --encryption-key-check (-1: not encrypted)")
	r.encCheck = fs.String("encryption-key-check", "", "the key check (hex) of the key the volume was created with: the engine refuses, before opening any replica, a key whose check differs")
	fs.IntVar(&c.readyFD, "ready-fd", -1, "once serving, write a JSON report (endpoint and its kind, control address, size) to this inherited descriptor and close it (-1: none)")
	return r
}

// apply checks the raw flags and sets what they give in c.
func (r *rawEngineFlags) apply(c *engineFlags, stderr io.Writer) error {
	if *r.size != "" {
		var err error
		if c.size, err = parseSize(*r.size); err != nil {
			return fmt.Errorf("--size: %w", err)
		}
	}
	switch c.frontend {
	case "nbd":
		if c.sock == "" {
			return errors.New("--frontend nbd needs --nbd-socket PATH")
		}
	case "fuse":
		if c.fuseDir == "" {
			return errors.New("--frontend fuse needs --fuse-dir DIR")
		}
	default:
		return fmt.Errorf("--frontend %q: use nbd or fuse", c.frontend)
	}
	c.nbdKernel = nbd.KernelMode(*r.nbdKernel)
	if c.nbdKernel != nbd.KernelAuto && c.nbdKernel != nbd.KernelOn && c.nbdKernel != nbd.KernelOff {
		return fmt.Errorf("--nbd-kernel %q: use auto, on or off", *r.nbdKernel)
	}
	if c.reattachWait < 0 {
		return fmt.Errorf("--nbd-reattach-wait %v: give a duration of 0 or more", c.reattachWait)
	}
	if err := checkReadyFD(c.readyFD); err != nil {
		return err
	}
	key, err := readKey(*r.keyFD)
	if err != nil {
		return err
	}
	c.key = key
	if c.cipher, err = encryption(c.name, *r.encKeyFD, *r.encCheck); err != nil {
		return err
	}
	if err := r.files.Check(); err != nil {
		return err
	}
	if r.files.Set() {
		if c.tls, err = tlsfiles.New(r.files, newLogger(stderr, "engine")); err != nil {
			return err
		}
	} else if c.dataTLS {
		return errors.New("--data-tls needs --tls-cert, --tls-key and --tls-client-ca")
	}
	shared, err := parseSize(*r.shared)
	if err != nil || shared < 0 || shared > 1<<31 {
		return fmt.Errorf("--shared-memory %q: give a size up to 2Gi, e.g. 32Mi, or 0 for none", *r.shared)
	}
	c.shared = shared
	return nil
}

func runEngine(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	ctx, handOver, stopWatching := watchHandOver(ctx)
	defer stopWatching()
	c, code := parseEngineFlags(args, stderr)
	if c == nil {
		return code
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "cairn-data engine: %v\n", err)
		return 1
	}
	log := newLogger(stderr, "engine")
	unsafeEarly := os.Getenv("CAIRN_UNSAFE_ACK_EARLY") == "1"
	if unsafeEarly {
		log.Info("WARNING: CAIRN_UNSAFE_ACK_EARLY=1: writes are acknowledged before every replica has them; " +
			"this mode exists only to prove the chaos harness catches the bug. Acknowledged data can be lost.")
	}
	region := sharedMemory(c, log)
	if region != nil {
		defer region.Close() // after the engine and the frontend (deferred later)
	}
	buffers := shm.NewArena(region)
	if region != nil { // the frontend's requests and ciphertext use shared buffers
		go releaseIdle(ctx, buffers, releaseIdleEvery, log)
	}
	go idlemem.Watch(ctx, idlemem.Period, idlemem.Release) // an idle volume's spare heap back to the node
	// The frontend's exclusive parts first: opening the replicas fences
	// out any engine that has them, so a second engine for a running
	// volume must fail before that.
	var claim *nbd.Frontend
	if c.frontend == "nbd" {
		var err error
		if claim, err = claimNBD(c, buffers, log); err != nil {
			return fail(err)
		}
		defer func() { // releases the claim if the frontend never starts; once started, f.stop did it
			if err := claim.Stop(); err != nil {
				log.Error(err, "releasing the nbd frontend's claim")
			}
		}()
	}
	var fclaim *fuseClaim
	if c.frontend == "fuse" {
		var err error
		if fclaim, err = claimFUSE(c, buffers, log); err != nil {
			return fail(err)
		}
		defer fclaim.close() // after f.stop: gives back a device taken over and never served
	}
	readyW, err := ready.NewWriter(c.readyFD)
	if err != nil {
		return fail(err)
	}
	e, err := openEngine(ctx, c, region, buffers, unsafeEarly, readyW, log)
	if err != nil {
		return fail(err)
	}
	defer e.Close()
	f, err := startFrontend(c, e, claim, fclaim, log)
	if err != nil {
		return fail(err)
	}
	defer f.stop()
	control, stopControl, err := serveControl(c, e, f, log)
	if err != nil {
		return fail(err)
	}
	defer stopControl()
	if err := reportReady(stdout, readyW, f, control, e.Size()); err != nil {
		return fail(err)
	}
	<-ctx.Done()
	shutdown(e, f, handOver(), log)
	return 0
}

// shutdown ends a running engine's service once its context ended: the
// frontend leaves its device to the next engine of the volume (handOver:
// the instance manager is going away) or detaches it, then the replicas
// are flushed, and, if the set is complete, told to clear their
// write-intent bits (engine.FinalFlush): no write comes any more, so the
// next engine has nothing to reconcile.
func shutdown(e *engine.Engine, f *frontend, handOver bool, log logr.Logger) {
	if handOver && f.leave != nil {
		log.Info("stopping for the instance manager, which is going away: leaving the device to the next engine of the volume, flushing")
		f.leave()
	} else {
		log.Info("stopping: detaching the frontend, flushing")
		f.stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := e.FinalFlush(ctx); err != nil {
		log.Error(err, "final flush failed")
	}
}

// watchHandOver returns a context that also ends when the engine gets
// instancemanager.HandOverSignal (its instance manager is going away, the
// volume stays attached), and a function that tells whether that is why
// it ended; stop ends the watch. Anything else that ends ctx (SIGTERM:
// the volume is detached here) is a plain stop.
func watchHandOver(ctx context.Context) (_ context.Context, handOver func() bool, stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, instancemanager.HandOverSignal)
	var got atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-sig:
			got.Store(true)
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, got.Load, func() {
		signal.Stop(sig)
		cancel()
		<-done
	}
}

// sharedMemory creates the memory shared with the replicas on this node
// (unix sockets): the frontend reads write payloads into it and those
// replicas write from it; replicas over TCP get the bytes as before. Nil
// without such replicas, with --shared-memory 0, or when it cannot be
// created (the log says why).
func sharedMemory(c *engineFlags, log logr.Logger) *shm.Region {
	if c.shared == 0 || !slices.ContainsFunc(c.replicas, func(r string) bool { return strings.HasPrefix(r, "unix:") }) {
		return nil
	}
	region, err := shm.Create(c.name, int(c.shared))
	if err != nil {
		log.Info("no shared memory with local replicas; writes reach them through the socket", "reason", err.Error())
		return nil
	}
	return region
}

// claimNBD takes the nbd frontend's socket and, for a kernel device, the
// volume's device lock (nbd.Claim).
func claimNBD(c *engineFlags, buffers *shm.Arena, log logr.Logger) (*nbd.Frontend, error) {
	l, err := listenUnix("--nbd-socket", c.sock)
	if err != nil {
		return nil, err
	}
	return nbd.Claim(nbd.FrontendOptions{Name: c.name, Listener: l, Socket: c.sock, Kernel: c.nbdKernel,
		ReattachWait: c.reattachWait, Buffers: buffers, Logger: log})
}

// openEngine opens the replicas (fencing out any engine that had them).
// An encrypted volume's ciphertext is written from buffers (over region),
// so it reaches local replicas through shared memory. While it waits for
// replicas, what it waits for goes to the ready descriptor as waiting
// lines: the instance manager shows it, and names it if it gives up on
// the engine.
func openEngine(ctx context.Context, c *engineFlags, region *shm.Region, buffers *shm.Arena, unsafeEarly bool, readyW *ready.Writer, log logr.Logger) (*engine.Engine, error) {
	octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	return engine.Open(octx, engine.Options{
		Name: c.name, Size: c.size, Replicas: c.replicas, Wanted: c.wanted, Logger: log, UnsafeAckEarly: unsafeEarly,
		Cipher: c.cipher, Buffers: buffers, ConnectTimeout: c.connectTimeout, AcceptLostMembers: c.acceptLost, IdleFlush: c.idleFlush,
		OnWait: func(w engine.Waiting) {
			if err := readyW.Waiting(w.String()); err != nil {
				log.Info("could not tell the instance manager what the engine waits for", "reason", err.Error())
			}
		},
		// One timer pings every replica (Pinger): an idle engine wakes
		// once per interval for them, not once per replica.
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{RequestTimeout: c.replicaTimeout, Logger: log, Shared: region, Key: c.key, TLS: c.dataClientTLS(),
			Pinger: dataconn.NewPinger(0, 0)},
			ControlTLS: c.clientTLS()}),
	})
}

// startFrontend serves the volume through the frontend asked for: the
// claimed nbd frontend, or the claimed fuse frontend (a FUSE mount with a
// loop device, or the ones it took over).
func startFrontend(c *engineFlags, e *engine.Engine, claim *nbd.Frontend, fclaim *fuseClaim, log logr.Logger) (*frontend, error) {
	if c.frontend == "fuse" {
		return startFUSE(e, fclaim, log)
	}
	if err := claim.Start(e); err != nil {
		return nil, fmt.Errorf("--nbd-kernel %s: %w", c.nbdKernel, err)
	}
	f := &frontend{endpoint: claim.Endpoint(), kind: ready.EndpointNBDSocket, socket: claim.Socket(), fallback: claim.Fallback(),
		inUse: claim.InUse, resumed: claim.Resumed(),
		resize: func(_ context.Context, size int64) error { return claim.Resize(size) },
		stop: func() {
			if err := claim.Stop(); err != nil {
				log.Error(err, "detaching the nbd frontend")
			}
		},
		leave: func() {
			if err := claim.Leave(); err != nil {
				log.Error(err, "leaving the nbd device to the next engine")
			}
		}}
	if claim.Device() != nil {
		f.kind = ready.EndpointBlockDevice
	}
	return f, nil
}

// serveControl serves the engine's gRPC control API on --listen and
// returns its address ("" without --listen) and how to stop it.
func serveControl(c *engineFlags, e *engine.Engine, f *frontend, log logr.Logger) (string, func(), error) {
	if c.listen == "" {
		return "", func() {}, nil
	}
	l, err := listen("--listen", c.listen)
	if err != nil {
		return "", nil, err
	}
	opts := []grpc.ServerOption{grpcalive.Serve()}
	if c.tls != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(c.tls.Server())))
	}
	gs := grpc.NewServer(opts...)
	enginev1.RegisterEngineServiceServer(gs, &engineserver.Server{E: e, Name: c.name, Frontend: c.frontend, Endpoint: f.endpoint,
		EndpointKind: f.kind, Socket: f.socket, Fallback: f.fallback, InUse: f.inUse, Resize: f.resize,
		DialSource: func(_ context.Context, addr string) (engine.CloneSource, error) {
			return replicaclient.DialSource(addr, 0, c.clientTLS())
		}})
	go func() {
		if err := gs.Serve(l); err != nil {
			log.Error(err, "the control API stopped serving")
		}
	}()
	return addrString(l), gs.Stop, nil
}

// reportReady prints the ready line (tests and hack/demo.sh read it) and
// writes the report to --ready-fd. The instance manager waits for that
// report; if it cannot have it (it closed its end: it gave up on this
// process), serving on would leave a volume nobody knows is up, so the
// error stops the engine.
func reportReady(stdout io.Writer, readyW *ready.Writer, f *frontend, control string, size int64) error {
	controlShown := control
	if controlShown == "" {
		controlShown = "none"
	}
	socketShown := ""
	if f.socket != "" {
		socketShown = " socket=" + f.socket
	}
	fmt.Fprintf(stdout, "ready endpoint=%s%s control=%s size=%d\n", f.endpoint, socketShown, controlShown, size)
	return readyW.Ready(ready.Report{Control: control, Size: size, Endpoint: f.endpoint,
		EndpointKind: f.kind, Socket: f.socket, Fallback: f.fallback, Resumed: f.resumed})
}

// releaseIdleEvery is how often the engine gives the shared memory of an
// idle volume back (an arena that handed out no buffer for a whole period).
const releaseIdleEvery = 30 * time.Second

// releaseIdle returns the pages of the shared memory's free buffers to the
// system whenever the volume was idle for a period (every), until ctx ends.
func releaseIdle(ctx context.Context, a *shm.Arena, every time.Duration, log logr.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := a.ReleaseIdle()
		if err != nil {
			log.Info("could not release idle shared memory", "reason", err.Error())
		} else if n > 0 {
			log.V(1).Info("released idle shared memory", "bytes", n)
		}
	}
}

// checkReadyFD refuses a --ready-fd that is not an open descriptor above
// stdin, stdout and stderr. Checked before the engine opens anything:
// otherwise the number could be taken by a socket the engine opens, and
// the report would go there.
func checkReadyFD(fd int) error {
	if fd < 0 {
		return nil
	}
	if fd <= 2 {
		return fmt.Errorf("--ready-fd %d: give a descriptor of 3 or more (0, 1 and 2 are stdin, stdout and stderr)", fd)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
		return fmt.Errorf("--ready-fd %d: not an open descriptor: %w", fd, err)
	}
	return nil
}

// readKey reads a volume's key from an inherited descriptor (the instance
// manager's key pipe: the key never appears in the arguments or the
// environment) and closes it; fd -1 means no key.
func readKey(fd int) ([]byte, error) {
	key, err := readKeyFD("--auth-key-fd", fd, dataconn.KeySize)
	if err != nil || key == nil {
		return nil, err
	}
	if err := dataconn.ValidKey(key); err != nil {
		return nil, fmt.Errorf("--auth-key-fd %d: %w", fd, err)
	}
	return key, nil
}

// readKeyFD reads a secret of at most size bytes (one more is read, to
// tell a longer one) from inherited descriptor fd, given by flag, and
// closes it; fd -1 means none (nil).
func readKeyFD(flag string, fd, size int) ([]byte, error) {
	if fd < 0 {
		return nil, nil
	}
	if fd <= 2 {
		return nil, fmt.Errorf("%s %d: give a descriptor of 3 or more (0, 1 and 2 are stdin, stdout and stderr)", flag, fd)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
		return nil, fmt.Errorf("%s %d: not an open descriptor: %w", flag, fd, err)
	}
	f := os.NewFile(uintptr(fd), strings.TrimPrefix(flag, "--"))
	defer f.Close()
	key, err := io.ReadAll(io.LimitReader(f, int64(size)+1))
	if err != nil {
		return nil, fmt.Errorf("%s %d: %w", flag, fd, err)
	}
	return key, nil
}

// encryption reads volume name's encryption key from fd (-1: the volume
// is not encrypted, nil) and checks it against check, the key check the
// volume was created with, before anything is opened: a wrong key would
// turn every read into noise and every write into data nobody can read.
// Neither the key nor any part of it is in an error.
func encryption(name string, fd int, check string) (*volcrypt.Cipher, error) {
	key, err := readKeyFD("--encryption-key-fd", fd, volcrypt.KeySize)
	if err != nil {
		return nil, err
	}
	defer clear(key) // the cipher keeps its own expanded keys
	switch {
	case key == nil && check == "":
		return nil, nil
	case key == nil:
		return nil, errors.New("--encryption-key-check needs --encryption-key-fd: the key it checks")
	case check == "":
		return nil, errors.New("--encryption-key-fd needs --encryption-key-check: the check of the key the volume was created with, so that a wrong key is refused before it is used")
	case len(key) != volcrypt.KeySize:
		return nil, fmt.Errorf("--encryption-key-fd %d: read %d bytes of key, want %d", fd, len(key), volcrypt.KeySize)
	case bytes.Equal(key, make([]byte, volcrypt.KeySize)):
		return nil, fmt.Errorf("--encryption-key-fd %d: a key of zeros", fd)
	}
	if got := volcrypt.KeyCheck(key); !strings.EqualFold(got, check) {
		return nil, fmt.Errorf("the encryption key given is not the key volume %s was created with (key check %s, want %s): "+
			"give the volume's own key; data written with another key cannot be read", name, got, check)
	}
	return volcrypt.New(key)
}

// dataClientTLS is the engine's TLS as a client of replicas' data ports
// (--data-tls), or nil.
func (c *engineFlags) dataClientTLS() *tls.Config {
	if !c.dataTLS {
		return nil
	}
	return c.clientTLS()
}

// clientTLS is the engine's TLS as a client of replicas' control APIs, or
// nil without --tls-*.
func (c *engineFlags) clientTLS() *tls.Config {
	if c.tls == nil {
		return nil
	}
	return c.tls.Client()
}
