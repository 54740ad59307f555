package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
)

// With --footprint-im the footprint table's volumes are started the way a
// node starts them: by one instance manager (cairn-data instance-manager on
// loopback, with the port range the DaemonSet gives it), through its gRPC
// API, each volume's three replicas (one on a unix socket, two on TCP
// ports) and its engine on that one instance manager. It asks for the
// volumes one after another and stops at the first that cannot be started,
// saying why: that is where one instance manager breaks. Then it prints
// what the instance manager itself holds (memory, threads, descriptors,
// ports) besides the per-volume table.
var (
	footprintIM       = flag.Bool("footprint-im", false, "with --footprint: start the volumes through one instance manager's gRPC API, as on a node, and report its own footprint and where it stops")
	footprintFrontend = flag.String("footprint-frontend", "nbd", "with --footprint-im: the engines' frontend, nbd (the socket only) or fuse (a FUSE mount and a loop device per volume, as on a kind node; root)")
	footprintPorts    = flag.String("footprint-port-range", "10000-11999", "with --footprint-im: the instance manager's --port-range (the DaemonSet's)")
	footprintWatch    = flag.Bool("footprint-watch", true, "with --footprint-im: hold a status stream (Watch) open to each engine for the whole run, as the engine controller does for every attached volume; false measures engines nobody watches")
)

// imVolume is one volume the instance manager runs: its processes' pids
// (engine first) and the fio arguments that reach its frontend.
type imVolume struct {
	pids    []int
	ports   int
	fio     []string
	control string // the engine's control address
}

// imBench is the instance manager under measurement.
type imBench struct {
	cmd  *exec.Cmd
	conn *grpc.ClientConn
	c    imv1.InstanceManagerServiceClient
	dir  string
}

func startIMBench(work string) *imBench {
	dir := filepath.Join(work, "im")
	must(os.MkdirAll(filepath.Join(dir, "data"), 0o755))
	cmd, f := startProc("instance-manager", "--listen", "127.0.0.1:0", "--node", "bench", "--data-dir", filepath.Join(dir, "data"),
		"--port-range", *footprintPorts, "--log-dir", filepath.Join(dir, "logs"), "--stop-grace", "10s")
	conn, err := grpc.NewClient(f["control"], grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(err)
	return &imBench{cmd: cmd, conn: conn, c: imv1.NewInstanceManagerServiceClient(conn), dir: dir}
}

// running creates a process and waits until it runs, or returns why not.
func (b *imBench) running(ctx context.Context, req *imv1.ProcessCreateRequest) (*imv1.Process, error) {
	if _, err := b.c.ProcessCreate(ctx, req); err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		p, err := b.c.ProcessGet(ctx, &imv1.ProcessGetRequest{Name: req.Name})
		if err != nil {
			return nil, fmt.Errorf("get %s: %w", req.Name, err)
		}
		switch p.State {
		case imv1.ProcessState_PROCESS_STATE_RUNNING:
			return p, nil
		case imv1.ProcessState_PROCESS_STATE_ERROR, imv1.ProcessState_PROCESS_STATE_STOPPED:
			return nil, fmt.Errorf("%s: %s: %s (log: %s)", req.Name, p.State, p.Error, strings.Join(p.LogTail, " | "))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s still %s after 3m (waiting: %s)", req.Name, p.State, p.Waiting)
		}
		time.Sleep(50 * time.Millisecond) // polling a state; the deadline above bounds it
	}
}

// volume starts one volume's replicas and engine; if one cannot start,
// it deletes those it started, so that they hold no ports or descriptors
// while the volumes that did start are measured.
func (b *imBench) volume(ctx context.Context, name string) (v imVolume, err error) {
	var created []string
	defer func() {
		if err != nil {
			for _, n := range created {
				_, _ = b.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: n})
			}
		}
	}()
	var addrs []*imv1.ReplicaAddress
	for i := range 3 {
		req := &imv1.ProcessCreateRequest{Name: fmt.Sprintf("%s-r%d", name, i), Spec: &imv1.ProcessCreateRequest_Replica{
			Replica: &imv1.ReplicaSpec{DataDir: filepath.Join(b.dir, "data", fmt.Sprintf("%s-r%d", name, i)),
				SizeBytes: int64(mustSize(*size)), UnixSocket: i == 0}}}
		created = append(created, req.Name)
		p, err := b.running(ctx, req)
		if err != nil {
			return v, err
		}
		v.pids, v.ports = append(v.pids, int(p.Pid)), v.ports+len(p.Ports)
		addrs = append(addrs, &imv1.ReplicaAddress{Data: p.DataAddress, Control: p.ControlAddress})
	}
	spec := &imv1.EngineSpec{VolumeName: name, Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF}
	if *footprintFrontend == "fuse" {
		spec.Frontend, spec.NbdKernel = imv1.Frontend_FRONTEND_FUSE, imv1.NBDKernel_NBD_KERNEL_AUTO
	}
	created = append(created, name)
	p, err := b.running(ctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{Engine: spec}})
	if err != nil {
		return v, err
	}
	v.pids, v.ports = append([]int{int(p.Pid)}, v.pids...), v.ports+len(p.Ports)
	v.control = p.ControlAddress
	switch ep := p.GetEndpoint(); {
	case ep == nil:
		return v, fmt.Errorf("engine %s runs without an endpoint", name)
	case ep.Kind == imv1.EndpointKind_ENDPOINT_KIND_LOOP_DEVICE:
		v.fio = []string{"--ioengine=libaio", "--direct=1", "--filename=" + ep.Path}
	default:
		v.fio = []string{"--ioengine=nbd", "--uri=nbd+unix:///" + name + "?socket=" + ep.Socket}
	}
	return v, nil
}

// engineWatches holds a status stream open to each engine, as the engine
// controller does (its own connection per engine, with keepalive), and
// counts the statuses the engines send.
type engineWatches struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	sent   atomic.Int64 // statuses received
	failed atomic.Int64 // streams that ended before cancel
}

func watchEngines(vols []imVolume) *engineWatches {
	ctx, cancel := context.WithCancel(context.Background())
	w := &engineWatches{cancel: cancel}
	for _, v := range vols {
		cc, err := grpc.NewClient(v.control, grpcalive.Dial(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		must(err)
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			defer cc.Close()
			st, err := enginev1.NewEngineServiceClient(cc).Watch(ctx, &enginev1.WatchRequest{})
			for err == nil {
				if _, err = st.Recv(); err == nil {
					w.sent.Add(1)
				}
			}
			if ctx.Err() == nil {
				w.failed.Add(1)
			}
		}()
	}
	return w
}

func (w *engineWatches) stop() {
	w.cancel()
	w.wg.Wait()
}

// stop deletes every process the instance manager runs, then stops it.
func (b *imBench) stop(ctx context.Context) {
	if l, err := b.c.ProcessList(ctx, &imv1.ProcessListRequest{}); err == nil {
		// Engines first: a replica deleted under its engine would only
		// make the engine complain.
		for _, kind := range []imv1.ProcessKind{imv1.ProcessKind_PROCESS_KIND_ENGINE, imv1.ProcessKind_PROCESS_KIND_REPLICA} {
			for _, p := range l.Processes {
				if p.Kind == kind {
					_, _ = b.c.ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: p.Name})
				}
			}
		}
	}
	b.conn.Close()
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	_ = b.cmd.Wait() // stopped by us: its exit status says nothing
}

func footprintIMTable(work string, n int) {
	fmt.Printf("\nfootprint through one instance manager: up to %d three-replica volumes (engine + 3 replicas each, %s each, frontend %s), port range %s, %s written to each, idle %s; %d CPUs\n",
		n, *size, *footprintFrontend, *footprintPorts, *footprintWrite, *footprintIdle, goruntime.NumCPU())
	if *footprintFrontend != "nbd" && *footprintFrontend != "fuse" {
		must(fmt.Errorf("--footprint-frontend %q: use nbd or fuse", *footprintFrontend))
	}
	ctx := context.Background()
	b := startIMBench(work)
	stop := func() { b.stop(ctx) }
	atExit = append(atExit, stop)
	defer stop()
	imStart := readProcMem(b.cmd.Process.Pid)
	var vols []imVolume
	var broke error
	start := time.Now()
	for i := range n {
		v, err := b.volume(ctx, fmt.Sprintf("fp-%03d", i))
		if err != nil {
			broke = err
			break
		}
		vols = append(vols, v)
		if (i+1)%50 == 0 {
			fmt.Printf("  %d volumes running after %s\n", i+1, time.Since(start).Round(time.Second))
		}
	}
	took := time.Since(start)
	if len(vols) == 0 {
		must(fmt.Errorf("no volume started: %w", broke))
	}
	fmt.Printf("  %d volumes (%d processes) started in %s, %.0f ms per volume\n", len(vols), 4*len(vols), took.Round(time.Second),
		float64(took.Milliseconds())/float64(len(vols)))
	if broke != nil {
		fmt.Printf("  STOPPED at volume %d: %v\n", len(vols), broke)
	}
	all := make([][]int, len(vols))
	for i, v := range vols {
		all[i] = v.pids
	}
	var w *engineWatches
	if *footprintWatch {
		w = watchEngines(vols)
		defer w.stop()
	}
	started := measureRoles(all)
	for _, v := range vols {
		writeVolume(v.fio)
	}
	written := measureRoles(all)
	time.Sleep(*footprintSettle) // an idle stretch is what is measured, not a wait for an event
	idle := measureRoles(all)
	var sentBefore int64
	if w != nil {
		sentBefore = w.sent.Load()
	}
	use := idleCPU(all)
	if w != nil {
		fmt.Printf("  status streams: one per engine, open for the whole run as the engine controller holds them; %d statuses sent in all, %d in the idle CPU window, %d streams ended early\n",
			w.sent.Load(), w.sent.Load()-sentBefore, w.failed.Load())
	} else {
		fmt.Printf("  status streams: none (--footprint-watch=false); on a cluster the engine controller holds one to every engine\n")
	}
	im := readProcMem(b.cmd.Process.Pid)
	ports := 0
	for _, v := range vols {
		ports += v.ports
	}
	printFootprint(started, written, idle, use, qemuYardstick(work))
	fmt.Printf("  instance manager: RSS %.1f MiB at start, %.1f MiB with %d volumes (%.2f MiB per volume), PSS %.1f MiB, %.0f threads, %.0f descriptors (%.1f per volume)\n",
		imStart.rss, im.rss, len(vols), (im.rss-imStart.rss)/float64(len(vols)), im.pss, im.threads, im.fds, (im.fds-imStart.fds)/float64(len(vols)))
	fmt.Printf("  ports: %d of the range's %d (%.0f per volume: each TCP replica a data and a control port, the unix-socket replica and the engine a control port)\n",
		ports, portRangeSize(*footprintPorts), float64(ports)/float64(len(vols)))
}

// mustSize parses a size as --size takes it: bytes, or a number with
// the suffix K, M or G (powers of 1024).
func mustSize(s string) uint64 {
	mult := uint64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult = 1 << 10
	case strings.HasSuffix(s, "M"):
		mult = 1 << 20
	case strings.HasSuffix(s, "G"):
		mult = 1 << 30
	}
	var n uint64
	_, err := fmt.Sscan(strings.TrimRight(s, "KMG"), &n)
	must(err)
	return n * mult
}

func portRangeSize(r string) int {
	var lo, hi int
	if _, err := fmt.Sscanf(r, "%d-%d", &lo, &hi); err != nil {
		return 0
	}
	return hi - lo + 1
}
