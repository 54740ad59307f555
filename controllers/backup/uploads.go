package backup

import (
	"context"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/event"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// uploads runs the upload goroutines: at most max at once, each under the
// runner's context (the manager's), each cancellable on its own.
type uploads struct {
	mu      sync.Mutex
	base    context.Context
	max     int
	running map[types.NamespacedName]*upload
	wg      sync.WaitGroup
	ch      chan event.GenericEvent
	once    sync.Once
}

// upload is one running or finished upload; done, res and err are
// written once, under uploads.mu.
type upload struct {
	cancel context.CancelFunc
	ended  chan struct{}
	done   bool
	res    *backupstore.BackupResult
	err    error
}

func (u *uploads) init() {
	u.once.Do(func() {
		u.running = map[types.NamespacedName]*upload{}
		u.ch = make(chan event.GenericEvent, 1024)
	})
}

// open sets the context uploads run under and their bound.
func (u *uploads) open(ctx context.Context, max int) {
	u.init()
	u.mu.Lock()
	defer u.mu.Unlock()
	u.base, u.max = ctx, max
}

// events is where an ended upload's Backup is announced.
func (u *uploads) events() <-chan event.GenericEvent {
	u.init()
	return u.ch
}

// state returns key's upload, if one is known (running or ended but not
// yet recorded).
func (u *uploads) state(key types.NamespacedName) (upload, bool) {
	u.init()
	u.mu.Lock()
	defer u.mu.Unlock()
	x, ok := u.running[key]
	if !ok {
		return upload{}, false
	}
	return upload{done: x.done, res: x.res, err: x.err}, true
}

// forget drops an ended upload whose outcome is recorded.
func (u *uploads) forget(key types.NamespacedName) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if x, ok := u.running[key]; ok && x.done {
		delete(u.running, key)
	}
}

// startResult says whether start started the upload, and why not.
type startResult int

const (
	started startResult = iota
	// startFull: max uploads run already.
	startFull
	// startNotRunning: the runner is not open (the manager has not
	// started it yet) or its context has ended.
	startNotRunning
)

// start runs fn for key in a goroutine, if the runner is open and fewer
// than max uploads run.
func (u *uploads) start(key types.NamespacedName, fn func(context.Context) (*backupstore.BackupResult, error)) startResult {
	u.init()
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.base == nil || u.base.Err() != nil {
		return startNotRunning
	}
	if u.active() >= u.max {
		return startFull
	}
	ctx, cancel := context.WithCancel(u.base)
	x := &upload{cancel: cancel, ended: make(chan struct{})}
	u.running[key] = x
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		defer cancel()
		res, err := fn(ctx)
		u.mu.Lock()
		x.done, x.res, x.err = true, res, err
		u.mu.Unlock()
		close(x.ended)
		b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}
		select {
		case u.ch <- event.GenericEvent{Object: b}:
		default: // no manager reads (tests poll), or it is flooded: the Backup's requeue covers it
		}
	}()
	return started
}

// active counts the uploads still running (mu held).
func (u *uploads) active() int {
	n := 0
	for _, x := range u.running {
		if !x.done {
			n++
		}
	}
	return n
}

// cancel stops key's upload, if any, and forgets it; it returns a channel
// closed once the upload's goroutine has ended (nil if there was none).
func (u *uploads) cancel(key types.NamespacedName) <-chan struct{} {
	u.init()
	u.mu.Lock()
	defer u.mu.Unlock()
	x, ok := u.running[key]
	if !ok {
		return nil
	}
	x.cancel()
	delete(u.running, key)
	return x.ended
}

// wait returns once every upload's goroutine has ended.
func (u *uploads) wait() { u.wg.Wait() }
