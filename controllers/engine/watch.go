package engine

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cairn-io/cairn/controllers/internal/stream"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/grpcalive"
)

// WatchOptions configure Watches.
type WatchOptions struct {
	// DialOptions for every engine connection; default: no transport
	// security (loopback tests; a cluster gives mutual TLS credentials).
	DialOptions []grpc.DialOption
	// MinBackoff and MaxBackoff bound the wait between watch attempts.
	// Defaults 100ms and 5s.
	MinBackoff, MaxBackoff time.Duration
	// OnChange is called (without locks held) with the Engine whose status
	// arrived or whose stream broke.
	OnChange func(types.NamespacedName)
	Logger   logr.Logger
}

// Watches follows the Watch stream of every running engine: one gRPC
// connection per engine process, the latest VolumeStatus it sent (replica
// modes, rebuild progress, snapshots, size), and whether that copy is
// current. Rebuild progress thus reaches the Engine's status as it
// happens, without a reconciler waiting on a call or polling.
type Watches struct {
	opts   WatchOptions
	mu     sync.Mutex
	m      map[types.NamespacedName]*Conn
	closed bool
	wg     sync.WaitGroup
}

// NewWatches returns an empty set; Close ends every stream.
func NewWatches(opts WatchOptions) *Watches {
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = 100 * time.Millisecond
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 5 * time.Second
	}
	if len(opts.DialOptions) == 0 {
		opts.DialOptions = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	if opts.OnChange == nil {
		opts.OnChange = func(types.NamespacedName) {}
	}
	return &Watches{opts: opts, m: map[types.NamespacedName]*Conn{}}
}

// Identity names one engine process: its control address, and its pid
// (0 when not known). A process restarted at the same address (the
// instance manager hands out the lowest free ports) is another identity.
type Identity struct {
	Address string
	PID     int32
}

// Conn is one engine process's control connection and its last status.
type Conn struct {
	Addr   string
	id     Identity
	Client enginev1.EngineServiceClient
	cc     *grpc.ClientConn
	cancel context.CancelFunc

	mu      sync.Mutex
	status  *enginev1.VolumeStatus
	current bool
	lastErr error
}

// Status returns the last status the engine sent and whether it is
// current (the stream is up). When it is not, err says why.
func (c *Conn) Status() (st *enginev1.VolumeStatus, current bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.status, c.current, c.lastErr
}

// Each calls fn with every engine followed now (without the lock held, so
// fn may call the engine).
func (w *Watches) Each(fn func(key types.NamespacedName, c *Conn)) {
	w.mu.Lock()
	conns := make(map[types.NamespacedName]*Conn, len(w.m))
	for k, c := range w.m {
		conns[k] = c
	}
	w.mu.Unlock()
	for k, c := range conns {
		fn(k, c)
	}
}

// Ensure returns the connection to the engine process id of key,
// starting its watch the first time, and replacing it (with the status it
// held) when the process is another: a new address, or a new pid at the
// same address. A status the old process sent is thus never taken for
// the new one's, even before the old stream has noticed it broke.
func (w *Watches) Ensure(key types.NamespacedName, id Identity) (*Conn, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, errors.New("engine watches: closed (the manager is stopping)")
	}
	if c, ok := w.m[key]; ok {
		if c.id == id {
			return c, nil
		}
		c.cancel()
		c.cc.Close()
		delete(w.m, key)
	}
	cc, err := grpc.NewClient(id.Address, append([]grpc.DialOption{grpcalive.Dial()}, w.opts.DialOptions...)...)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Conn{Addr: id.Address, id: id, Client: enginev1.NewEngineServiceClient(cc), cc: cc, cancel: cancel}
	w.m[key] = c
	w.wg.Add(1)
	go func() { defer w.wg.Done(); w.run(ctx, key, c) }()
	return c, nil
}

// Stop ends the watch of key (its engine is stopped or gone).
func (w *Watches) Stop(key types.NamespacedName) {
	w.mu.Lock()
	c, ok := w.m[key]
	delete(w.m, key)
	w.mu.Unlock()
	if ok {
		c.cancel()
		c.cc.Close()
	}
}

// Close ends every watch and waits for them.
func (w *Watches) Close() {
	w.mu.Lock()
	w.closed = true
	for key, c := range w.m {
		c.cancel()
		c.cc.Close()
		delete(w.m, key)
	}
	w.mu.Unlock()
	w.wg.Wait()
}

// run keeps c's status current until ctx ends, watching again with
// back-off whenever the stream breaks.
func (w *Watches) run(ctx context.Context, key types.NamespacedName, c *Conn) {
	log := w.opts.Logger.WithValues("engine", key.String(), "address", c.Addr)
	stream.Keep(ctx, w.opts.MinBackoff, w.opts.MaxBackoff, func(ctx context.Context) (bool, error) { return w.watchOnce(ctx, key, c) },
		func(err error) {
			c.mu.Lock()
			wasCurrent := c.current
			c.current, c.lastErr = false, err
			c.mu.Unlock()
			if wasCurrent {
				log.Info("lost the engine's status stream; watching again", "reason", err.Error())
				w.opts.OnChange(key)
			}
		})
}

func (w *Watches) watchOnce(ctx context.Context, key types.NamespacedName, c *Conn) (got bool, err error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.Client.Watch(wctx, &enginev1.WatchRequest{})
	if err != nil {
		return false, err
	}
	for {
		vs, err := st.Recv()
		if err != nil {
			return got, err
		}
		got = true
		c.mu.Lock()
		c.status, c.current, c.lastErr = vs, true, nil
		c.mu.Unlock()
		w.opts.OnChange(key)
	}
}
