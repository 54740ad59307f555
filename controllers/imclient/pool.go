// Package imclient keeps one gRPC connection to each instance manager,
// shared by every reconciler, and a live copy of the processes each one
// supervises, fed by its ProcessWatch stream (not by polling). A stream
// that breaks is redialled with back-off; meanwhile the copy says it is
// not current, and reconcilers report the processes as unknown instead of
// trusting stale states. A connection whose watch is down and that nobody
// has asked for in Options.IdleTimeout is closed: an instance manager that
// came back at another address (a new pod IP) leaves its old address to
// nobody, and its connection would otherwise redial it for ever.
package imclient

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/stream"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
)

// Options configure a Pool.
type Options struct {
	// DialOptions for every connection; default: no transport security
	// (tests and loopback only; a cluster gives mutual TLS credentials).
	DialOptions []grpc.DialOption
	// MinBackoff and MaxBackoff bound the wait between watch attempts.
	// Defaults 100ms and 10s.
	MinBackoff, MaxBackoff time.Duration
	// OnChange is called (without locks held) with the address of an
	// instance manager whose processes or connection state changed; the
	// manager turns it into reconcile requests.
	OnChange func(addr string)
	// IdleTimeout: a connection whose watch is down and that no Get asked
	// for in this long is closed. Default 5 minutes. The reconcilers ask
	// for a named instance manager's address far more often (the
	// StorageNode reconciler every 30 s, an Engine or Replica on an
	// unreachable node every 5 s), so only addresses nothing names any
	// more go.
	IdleTimeout time.Duration
	Logger      logr.Logger
}

// Pool holds the connections, by address.
type Pool struct {
	opts   Options
	ctx    context.Context
	cancel context.CancelFunc

	mu    sync.Mutex
	conns map[string]*Conn
	wg    sync.WaitGroup
}

// New returns an empty pool; Close ends every connection.
func New(opts Options) *Pool {
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = 100 * time.Millisecond
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 10 * time.Second
	}
	if len(opts.DialOptions) == 0 {
		opts.DialOptions = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	if opts.OnChange == nil {
		opts.OnChange = func(string) {}
	}
	if opts.IdleTimeout <= 0 {
		opts.IdleTimeout = 5 * time.Minute
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Pool{opts: opts, ctx: ctx, cancel: cancel, conns: map[string]*Conn{}}
	p.wg.Add(1)
	go func() { defer p.wg.Done(); p.sweep(ctx) }()
	return p
}

// sweep closes, until ctx ends, the connections idle for longer than
// IdleTimeout while their watch is down.
func (p *Pool) sweep(ctx context.Context) {
	t := time.NewTicker(max(p.opts.IdleTimeout/4, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, addr := range p.idle(time.Now()) {
			p.opts.Logger.Info("closing the connection to an instance manager nothing has asked for while it is unreachable", "instanceManager", addr, "idle", p.opts.IdleTimeout.String())
		}
	}
}

// idle closes the connections idle at now and returns their addresses.
// Get marks a connection used under the same lock, so a connection just
// handed out is never closed.
func (p *Pool) idle(now time.Time) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for addr, c := range p.conns {
		c.mu.Lock()
		current := c.current
		c.mu.Unlock()
		if current || now.Sub(time.Unix(0, c.lastUsed.Load())) < p.opts.IdleTimeout {
			continue
		}
		delete(p.conns, addr)
		c.cancel()
		c.cc.Close()
		out = append(out, addr)
	}
	return out
}

// Conn is one instance manager: its client, and its processes as the
// watch stream last reported them.
type Conn struct {
	Addr   string
	Client imv1.InstanceManagerServiceClient
	cc     *grpc.ClientConn
	cancel context.CancelFunc

	// settled is closed when the first watch has delivered its snapshot
	// or failed: until then "not current" means "not known yet", not
	// "unreachable".
	settled    chan struct{}
	settleOnce sync.Once
	waitedOut  atomic.Bool  // a WaitSettled ran out of time
	lastUsed   atomic.Int64 // unix nanoseconds of the last Get

	mu      sync.Mutex
	current bool // the stream is up and its snapshot arrived
	procs   map[string]*imv1.Process
	lastErr error
	seq     uint64
}

// Get returns the connection to addr, dialling it and starting its watch
// the first time.
func (p *Pool) Get(addr string) (*Conn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.conns[addr]; ok {
		c.lastUsed.Store(time.Now().UnixNano())
		return c, nil
	}
	if p.ctx.Err() != nil {
		return nil, errors.New("imclient: pool closed")
	}
	cc, err := grpc.NewClient(addr, append([]grpc.DialOption{grpcalive.Dial()}, p.opts.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("instance manager %s: %w", addr, err)
	}
	ctx, cancel := context.WithCancel(p.ctx)
	c := &Conn{Addr: addr, Client: imv1.NewInstanceManagerServiceClient(cc), cc: cc, cancel: cancel, procs: map[string]*imv1.Process{}, settled: make(chan struct{})}
	c.lastUsed.Store(time.Now().UnixNano())
	p.conns[addr] = c
	p.wg.Add(1)
	go func() { defer p.wg.Done(); p.watch(ctx, c) }()
	return c, nil
}

// Forget closes the connection to addr (its instance manager is gone).
func (p *Pool) Forget(addr string) {
	p.mu.Lock()
	c, ok := p.conns[addr]
	delete(p.conns, addr)
	p.mu.Unlock()
	if ok {
		c.cancel()
		c.cc.Close()
	}
}

// Close ends every connection and waits for the watches to stop.
func (p *Pool) Close() {
	p.cancel()
	p.mu.Lock()
	for addr, c := range p.conns {
		c.cc.Close()
		delete(p.conns, addr)
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// FirstSyncWait bounds how long WaitSettled waits for a new connection's
// first process watch.
const FirstSyncWait = 3 * time.Second

// WaitSettled waits, at most FirstSyncWait or until ctx ends, until the
// connection's first watch has delivered the processes or failed. A
// reconciler that reads a new connection (the manager has just started)
// then reports what the instance manager runs, not "unknown" for the
// moment the stream takes to come up.
//
// Once a wait has run out without an answer (an address that swallows
// packets: the first watch fails only when gRPC's connect gives up), the
// connection's next callers do not wait, so reconciles of other nodes are
// not held up 3 s each meanwhile.
func (c *Conn) WaitSettled(ctx context.Context) {
	if c.waitedOut.Load() {
		return
	}
	t := time.NewTimer(FirstSyncWait)
	defer t.Stop()
	select {
	case <-c.settled:
	case <-t.C:
		c.waitedOut.Store(true)
	case <-ctx.Done():
	}
}

func (c *Conn) settle() { c.settleOnce.Do(func() { close(c.settled) }) }

// Processes returns a copy of the processes by name, and whether the copy
// is current. When it is not (the stream is down, or not up yet), err says
// why and the states must be taken as unknown.
func (c *Conn) Processes() (procs map[string]*imv1.Process, current bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]*imv1.Process, len(c.procs))
	for k, v := range c.procs {
		out[k] = v
	}
	return out, c.current, c.lastErr
}

// Process returns one process: ok=false when the copy is current and has
// no such process; current=false when the copy cannot be trusted.
func (c *Conn) Process(name string) (p *imv1.Process, ok, current bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok = c.procs[name]
	return p, ok, c.current
}

// watch keeps the copy current until ctx ends: watch, apply events, and on
// any break mark the copy stale, wait, and watch again.
func (p *Pool) watch(ctx context.Context, c *Conn) {
	log := p.opts.Logger.WithValues("instanceManager", c.Addr)
	stream.Keep(ctx, p.opts.MinBackoff, p.opts.MaxBackoff, func(ctx context.Context) (bool, error) { return p.watchOnce(ctx, c) },
		func(err error) {
			c.mu.Lock()
			wasCurrent := c.current
			c.current, c.lastErr = false, err
			c.mu.Unlock()
			c.settle()
			if wasCurrent {
				log.Info("lost the process watch; processes are unknown until it is back", "reason", err.Error())
				p.opts.OnChange(c.Addr)
			}
		})
}

// watchOnce runs one watch stream until it breaks.
func (p *Pool) watchOnce(ctx context.Context, c *Conn) (gotSnapshot bool, err error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.Client.ProcessWatch(wctx, &imv1.ProcessWatchRequest{}, grpc.WaitForReady(false))
	if err != nil {
		return false, err
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			return gotSnapshot, err
		}
		c.mu.Lock()
		switch ev.GetType() {
		case imv1.ProcessEvent_TYPE_SNAPSHOT:
			c.procs = make(map[string]*imv1.Process, len(ev.GetProcesses()))
			for _, pr := range ev.GetProcesses() {
				c.procs[pr.GetName()] = pr
			}
			c.current, c.lastErr, gotSnapshot = true, nil, true
			c.settle()
		case imv1.ProcessEvent_TYPE_UPDATE, imv1.ProcessEvent_TYPE_DELETE:
			if !gotSnapshot || ev.GetSeq() != c.seq+1 {
				c.mu.Unlock()
				return gotSnapshot, fmt.Errorf("watch event seq %d after %d: missed events", ev.GetSeq(), c.seq)
			}
			if ev.GetType() == imv1.ProcessEvent_TYPE_DELETE {
				delete(c.procs, ev.GetProcess().GetName())
			} else {
				c.procs[ev.GetProcess().GetName()] = ev.GetProcess()
			}
		}
		c.seq = ev.GetSeq()
		c.mu.Unlock()
		p.opts.OnChange(c.Addr)
	}
}

// ErrNoInstanceManager: no InstanceManager with an address runs on the
// node.
var ErrNoInstanceManager = errors.New("no instance manager")

// ForNode returns the connection to the instance manager of a node: the
// InstanceManager object in namespace whose spec.nodeName is node and
// whose spec.address is set.
func (p *Pool) ForNode(ctx context.Context, c client.Reader, namespace, node string) (*Conn, *v1.InstanceManager, error) {
	var ims v1.InstanceManagerList
	if err := c.List(ctx, &ims, client.InNamespace(namespace)); err != nil {
		return nil, nil, err
	}
	for i := range ims.Items {
		im := &ims.Items[i]
		if im.Spec.NodeName == node && im.Spec.Address != "" {
			conn, err := p.Get(im.Spec.Address)
			if err == nil {
				conn.WaitSettled(ctx)
			}
			return conn, im, err
		}
	}
	return nil, nil, fmt.Errorf("%w on node %q: an InstanceManager with spec.nodeName %q and an address is needed", ErrNoInstanceManager, node, node)
}
