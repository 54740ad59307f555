package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/engineserver"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/frontend/nbd"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
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
	inUse    func() string
	// resize has the block device show the volume's new size after an
	// expansion; nil without a device.
	resize func(ctx context.Context, size int64) error
	stop   func()
}

// nbdClaim is what the nbd frontend takes before the engine opens the
// replicas, which fences out whatever engine had them (it bumps their
// epoch): the NBD socket and, where the kernel device will be used, the
// volume's device lock. A second engine started by mistake for a running
// volume fails here and leaves the running one alone.
type nbdClaim struct {
	name, sock, kernel string
	l                  net.Listener
	// lock is the abstract unix socket "@cairn-nbd/NAME", held while this
	// engine may own the volume's /dev/nbdN (the kernel frees it when the
	// process dies, however it dies); nil without a kernel device.
	lock net.Listener
	// noDevice says why there is no kernel device (nil with one, or
	// with --nbd-kernel off).
	noDevice error
}

// claimNBD takes the socket and, unless kernel is "off" or the kernel has
// no nbd driver, the device lock.
func claimNBD(name, sock, kernel string) (*nbdClaim, error) {
	if sock == "" {
		return nil, errors.New("--frontend nbd needs --nbd-socket PATH")
	}
	c := &nbdClaim{name: name, sock: sock, kernel: kernel}
	if kernel != "off" {
		c.noDevice = nbd.KernelDriver()
		if c.noDevice != nil && kernel == "on" {
			return nil, fmt.Errorf("--nbd-kernel on: %w", c.noDevice)
		}
	}
	l, err := listenUnix("--nbd-socket", sock)
	if err != nil {
		return nil, err
	}
	c.l = l
	if kernel != "off" && c.noDevice == nil {
		lock, err := net.Listen("unix", "@cairn-nbd/"+name)
		if err != nil {
			c.release()
			return nil, fmt.Errorf("volume %s: another engine on this node owns its /dev/nbdN (it holds the abstract socket @cairn-nbd/%s: %v); stop that engine first", name, name, err)
		}
		c.lock = lock
	}
	return c, nil
}

// release gives the claim up (when the engine stops, or fails to start).
func (c *nbdClaim) release() {
	c.l.Close()
	os.Remove(c.sock)
	if c.lock != nil {
		c.lock.Close()
	}
}

// startNBD serves the volume on the claimed socket and, where the claim
// holds the device lock, attaches it to a /dev/nbdN through the kernel's
// nbd driver; the device is then the endpoint. With --nbd-kernel auto a
// host without the driver (or without the privilege) gets the socket as
// the endpoint, and the log says why; with "on" that is an error.
func startNBD(e *engine.Engine, c *nbdClaim, reattachWait time.Duration, buffers *shm.Arena, log func(string)) (*frontend, error) {
	s := nbd.NewServer(e, nbd.Options{ExportName: c.name, Buffers: buffers})
	go func() {
		if err := s.Serve(c.l); err != nil {
			log("nbd listener failed: " + err.Error())
		}
	}()
	f := &frontend{endpoint: c.sock, kind: ready.EndpointNBDSocket, socket: c.sock, stop: func() { s.Close(); c.release() }}
	f.inUse = func() string {
		if n := s.Clients(); n > 0 {
			return fmt.Sprintf("%d NBD client connection(s)", n)
		}
		return ""
	}
	if c.kernel == "off" {
		return f, nil
	}
	var kd *nbd.KernelDevice
	err := c.noDevice // never set with "on": claimNBD refused that
	if err == nil {
		kd, err = attachKernel(s, c.name, reattachWait, log)
	}
	if err != nil {
		var owned *deviceOwnedError
		if c.kernel == "on" || errors.As(err, &owned) {
			f.stop()
			return nil, fmt.Errorf("--nbd-kernel %s: %w", c.kernel, err)
		}
		f.fallback = err.Error()
		log("no /dev/nbdN, serving the NBD socket " + c.sock + " only: " + f.fallback)
		return f, nil
	}
	f.endpoint, f.kind = kd.Path(), ready.EndpointBlockDevice
	f.inUse = func() string { return "attached as " + kd.Path() }
	f.resize = func(_ context.Context, size int64) error { return kd.Resize(size) }
	stopSocket := f.stop
	f.stop = func() {
		if err := kd.Disconnect(); err != nil {
			log(err.Error())
		}
		stopSocket()
	}
	return f, nil
}

// deviceOwnedError: the volume's /dev/nbdN exists and this engine cannot
// take it; serving the socket alone would leave whatever uses the device
// without a server, so even --nbd-kernel auto stops.
type deviceOwnedError struct{ error }

func (e *deviceOwnedError) Unwrap() error { return e.error }

// attachKernel attaches the volume to a /dev/nbdN, or reattaches the one
// an engine of the same volume left behind when it died: a device whose
// backend is the volume's name and which is still configured (the caller
// holds the volume's device lock, so that engine is gone). The kernel
// holds that device's I/O for up to reattachWait after its engine died, so
// a filesystem mounted on it carries on once the new engine is up.
func attachKernel(s *nbd.Server, name string, reattachWait time.Duration, log func(string)) (*nbd.KernelDevice, error) {
	opts := nbd.KernelOptions{Backend: name, DeadConnTimeoutSeconds: uint64((reattachWait + time.Second - 1) / time.Second)}
	if index, found := nbd.FindKernelDevice(name); found {
		kd, err := nbd.ReattachKernel(s, index, opts)
		if err != nil {
			return nil, &deviceOwnedError{fmt.Errorf("/dev/nbd%d belongs to volume %s, left by an engine that stopped without detaching it, and reattaching it failed: %w; "+
				"release it with `nbd-client -d /dev/nbd%d` (writes it holds are lost) and start the engine again", index, name, err, index)}
		}
		log(fmt.Sprintf("reattached %s, left attached by an engine of volume %s that stopped without detaching it; the I/O it held goes on", kd.Path(), name))
		return kd, nil
	}
	kd, err := nbd.ConnectKernel(s, opts)
	if err != nil {
		return nil, err
	}
	log("attached " + kd.Path() + " through the kernel's nbd driver")
	return kd, nil
}

func runEngine(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data engine", flag.ContinueOnError)
	fs.SetOutput(stderr)
	name := fs.String("name", "", "volume name (required)")
	sizeFlag := fs.String("size", "", "volume size, e.g. 10Gi (default: the replicas' size)")
	var replicas stringList
	fs.Var(&replicas, "replica", "replica address HOST:PORT (control on PORT+1) or DATA,CONTROL; repeat for each replica (required)")
	wanted := fs.Int("wanted", 0, "replicas that make the volume healthy (default: the number of --replica)")
	fe := fs.String("frontend", "nbd", "how to expose the volume: nbd or fuse")
	sock := fs.String("nbd-socket", "", "unix socket path for the nbd frontend")
	nbdKernel := fs.String("nbd-kernel", "auto", "attach the nbd frontend to a /dev/nbdN through the kernel's nbd driver: auto (if the host has it), on (required), off (socket only)")
	reattachWait := fs.Duration("nbd-reattach-wait", 2*time.Minute, "if the engine dies, how long the kernel holds /dev/nbdN's I/O for a restarted engine to reattach it (0: fail the I/O at once)")
	fuseDir := fs.String("fuse-dir", "", "mount directory for the fuse frontend")
	listenAddr := fs.String("listen", "", "host:port for the gRPC control API (default: none)")
	sharedFlag := fs.String("shared-memory", "32Mi", "memory shared with replicas on unix sockets, for NBD writes to reach them without a socket copy; 0 turns it off")
	timeout := fs.Duration("replica-timeout", 8*time.Second, "a replica that does not answer a request in this time is failed")
	readyFD := fs.Int("ready-fd", -1, "once serving, write a JSON report (endpoint and its kind, control address, size) to this inherited descriptor and close it (-1: none)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cairn-data engine --name NAME --replica HOST:PORT ... --frontend nbd|fuse [--nbd-socket PATH [--nbd-kernel auto|on|off] | --fuse-dir DIR] [--listen HOST:PORT]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "cairn-data engine: "+format+"\n", a...)
		return 1
	}
	if *name == "" || len(replicas) == 0 {
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
	if *fe != "nbd" && *fe != "fuse" {
		return fail("--frontend %q: use nbd or fuse", *fe)
	}
	if *nbdKernel != "auto" && *nbdKernel != "on" && *nbdKernel != "off" {
		return fail("--nbd-kernel %q: use auto, on or off", *nbdKernel)
	}
	if *reattachWait < 0 {
		return fail("--nbd-reattach-wait %v: give a duration of 0 or more", *reattachWait)
	}
	if err := checkReadyFD(*readyFD); err != nil {
		return fail("%v", err)
	}
	shared, err := parseSize(*sharedFlag)
	if err != nil || shared < 0 || shared > 1<<31 {
		return fail("--shared-memory %q: give a size up to 2Gi, e.g. 32Mi, or 0 for none", *sharedFlag)
	}
	log := newLogger(stderr, "engine")
	unsafeEarly := os.Getenv("CAIRN_UNSAFE_ACK_EARLY") == "1"
	if unsafeEarly {
		log.Info("WARNING: CAIRN_UNSAFE_ACK_EARLY=1: writes are acknowledged before every replica has them; " +
			"this mode exists only to prove the chaos harness catches the bug. Acknowledged data can be lost.")
	}
	// Memory shared with the replicas on this node (unix sockets): the NBD
	// frontend reads write payloads into it and those replicas write from
	// it; replicas over TCP get the bytes as before.
	var region *shm.Region
	if shared > 0 && slices.ContainsFunc(replicas, func(r string) bool { return strings.HasPrefix(r, "unix:") }) {
		if region, err = shm.Create(*name, int(shared)); err != nil {
			log.Info("no shared memory with local replicas; writes reach them through the socket", "reason", err.Error())
		} else {
			defer region.Close() // after the engine and the frontend (deferred later)
		}
	}
	// The frontend's exclusive parts first: opening the replicas fences
	// out any engine that has them, so a second engine for a running
	// volume must fail before that.
	var claim *nbdClaim
	if *fe == "nbd" {
		if claim, err = claimNBD(*name, *sock, *nbdKernel); err != nil {
			return fail("%v", err)
		}
	}
	started := false
	defer func() {
		if claim != nil && !started {
			claim.release()
		}
	}()
	octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	e, err := engine.Open(octx, engine.Options{
		Name: *name, Size: size, Replicas: replicas, Wanted: *wanted, Logger: log, UnsafeAckEarly: unsafeEarly,
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{RequestTimeout: *timeout, Logger: log, Shared: region}}),
	})
	if err != nil {
		return fail("%v", err)
	}
	defer e.Close()
	var f *frontend
	switch *fe {
	case "nbd":
		arena := shm.NewArena(region)
		if region != nil {
			go releaseIdle(ctx, arena, releaseIdleEvery, log)
		}
		f, err = startNBD(e, claim, *reattachWait, arena, func(m string) { log.Info(m) })
		started = true // the frontend releases the claim, also when it failed
	case "fuse":
		if *fuseDir == "" {
			return fail("--frontend fuse needs --fuse-dir DIR")
		}
		f, err = startFUSE(e, *name, *fuseDir, log)
	}
	if err != nil {
		return fail("%v", err)
	}
	defer f.stop()
	controlShown, control := "none", ""
	if *listenAddr != "" {
		l, err := listen("--listen", *listenAddr)
		if err != nil {
			return fail("%v", err)
		}
		gs := grpc.NewServer()
		enginev1.RegisterEngineServiceServer(gs, &engineserver.Server{E: e, Name: *name, Frontend: *fe, Endpoint: f.endpoint,
			EndpointKind: f.kind, Socket: f.socket, Fallback: f.fallback, InUse: f.inUse, Resize: f.resize})
		go gs.Serve(l)
		defer gs.Stop()
		control = addrString(l)
		controlShown = control
	}
	socketShown := ""
	if f.socket != "" {
		socketShown = " socket=" + f.socket
	}
	fmt.Fprintf(stdout, "ready endpoint=%s%s control=%s size=%d\n", f.endpoint, socketShown, controlShown, e.Size())
	// The instance manager waits for this report; if it cannot get it
	// (it closed its end: it gave up on this process), serving on would
	// leave a volume nobody knows is up, so the engine stops.
	if err := ready.Write(*readyFD, ready.Report{Control: control, Size: e.Size(), Endpoint: f.endpoint,
		EndpointKind: f.kind, Socket: f.socket, Fallback: f.fallback}); err != nil {
		return fail("%v", err)
	}
	<-ctx.Done()
	log.Info("stopping: detaching the frontend, flushing")
	f.stop()
	fctx, fcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer fcancel()
	if err := e.Flush(fctx); err != nil {
		log.Error(err, "final flush failed")
	}
	return 0
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
