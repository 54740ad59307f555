package engineserver

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/engine"
)

// The status a Watch stream sends is sampled: the server reads what the
// engine exports (modes, rebuilds, snapshots, size) and sends a message
// only when that differs, so the watchers never poll and an unchanged
// volume sends them nothing. The sampler looks when something may have
// changed, not on a fixed tick: when the engine signals a change (a mode,
// a member, the epoch, the size, a rebuild or clone starting or ending,
// the layers), when a call through this server may have changed the state
// (snapshot, expand, add...), every watchInterval while a rebuild or a
// clone runs (their progress), and every usageInterval otherwise. An idle
// volume whose engine is watched (the engine controller watches every
// attached one) thus costs a wake-up every usageInterval, and its replica
// nothing.
//
// The snapshots and the data bytes live on a replica and cost a call to
// it, so a sample asks for them only when they may have changed: after a
// call through this server or a change of the layers the engine counts
// (LayerChanges), and at most every usageInterval while the volume is
// written (Mutations: writes change the data bytes). A wake-up of the
// timer with none of that and no rebuild or clone running reads two
// counters and nothing else: an idle process runs as little of its code
// as it can, so that the pages of code it unmapped when it went idle
// (internal/idlemem) stay unmapped.

// watchInterval is how often the sampler looks while a rebuild or a clone
// runs, or while the replica's answer is missing.
const watchInterval = 200 * time.Millisecond

// snapshotTimeout bounds the replica call that lists the snapshots in one
// sample; when it fails, the status keeps the snapshots it had.
const snapshotTimeout = 2 * time.Second

// usageInterval is how often a sample takes the replica's data bytes
// (VolumeStatus.actual_size) anew while the volume is written: they change
// with nearly every write to a new block, and each change is a status
// update the reconciler writes to the API server. A call through this
// server that may change them (snapshot, revert, expand...) has the next
// sample take them at once. It is also the longest the sampler sleeps.
const usageInterval = 10 * time.Second

// watchers is what a Server's Watch streams share: the latest status and
// its seq, and one sampler goroutine while any stream is open.
type watchers struct {
	mu       sync.Mutex
	open     int                    // Watch streams open
	stop     context.CancelFunc     // stops the sampler; nil when none runs
	latest   *enginev1.VolumeStatus // the last status sampled; never changed once set
	updated  chan struct{}          // closed, and replaced, when latest is
	poke     chan struct{}          // asks the sampler to look now (one pending at most)
	sampling sync.Mutex             // one sample at a time
	// usageAt and usageMutations are when a sample last took the actual
	// size and the engine's Mutations then; layersGen is LayerChanges when
	// a sample last had the replica's layers; layersRetry: the last ask
	// failed, ask at the next sample (all under sampling).
	usageAt        time.Time
	usageMutations uint64
	layersGen      uint64
	layersRetry    bool
	// samples and asks count the samples that read the engine's state and
	// the replica calls they made (read by tests).
	samples, asks atomic.Uint64
	// idle is the longest the sampler sleeps without a signal:
	// usageInterval unless a test sets it before the first Watch.
	idle time.Duration
	// usageStale: a call changed the layers; the next sample takes the
	// actual size whatever usageAt says.
	usageStale bool
}

func (w *watchers) initLocked() {
	if w.updated == nil {
		w.updated = make(chan struct{})
		w.poke = make(chan struct{}, 1)
	}
}

// current returns the latest status and a channel closed when it is
// replaced.
func (w *watchers) current() (*enginev1.VolumeStatus, <-chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.latest, w.updated
}

// Watch sends the status at once, then each new status the sampler
// publishes. A stream slower than the changes skips to the latest one.
func (s *Server) Watch(_ *enginev1.WatchRequest, stream grpc.ServerStreamingServer[enginev1.VolumeStatus]) error {
	ctx := stream.Context()
	s.join(ctx)
	defer s.leave()
	var sent uint64
	for {
		st, updated := s.watch.current()
		if st.GetSeq() != sent {
			if err := stream.Send(st); err != nil {
				return err
			}
			sent = st.GetSeq()
		}
		select {
		case <-updated:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// join counts a new stream in, samples the state so that its first
// message is the status as it is now, and starts the sampler for the
// first stream.
func (s *Server) join(ctx context.Context) {
	w := &s.watch
	w.mu.Lock()
	w.initLocked()
	w.open++
	var sctx context.Context
	if w.stop == nil {
		sctx, w.stop = context.WithCancel(context.Background())
	}
	poke := w.poke
	w.mu.Unlock()
	s.sample(ctx, true)
	if sctx != nil {
		go s.sampler(sctx, poke)
	}
}

// leave counts a stream out and stops the sampler after the last one.
func (s *Server) leave() {
	w := &s.watch
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.open--; w.open == 0 {
		w.stop()
		w.stop = nil
	}
}

// changed has the sampler look now: a call through this server changed
// the state, or may have.
func (s *Server) changed() {
	w := &s.watch
	w.mu.Lock()
	poke := w.poke
	w.usageStale = true
	w.mu.Unlock()
	select {
	case poke <- struct{}{}: // nil (nobody ever watched): never ready
	default:
	}
}

func (s *Server) sampler(ctx context.Context, poke <-chan struct{}) {
	t := time.NewTimer(usageInterval)
	defer t.Stop()
	look := true
	for {
		changed := s.E.Changed() // before sampling: a change while it runs wakes the next
		t.Reset(s.sample(ctx, look))
		select {
		case <-ctx.Done():
			return
		case <-changed:
			look = true
		case <-poke:
			look = true
		case <-t.C:
			look = false
		}
	}
}

// sample reads the engine's state and, if it differs from the latest
// status, publishes it with the next seq. look: something may have
// changed (a signal, a call, the first sample); without it, only a
// running rebuild or clone, a failed ask or the volume's writes make it
// look. It returns how long the sampler may wait for a signal before it
// looks again.
func (s *Server) sample(ctx context.Context, look bool) time.Duration {
	w := &s.watch
	w.sampling.Lock()
	defer w.sampling.Unlock()
	prev, _ := w.current()
	mutations, gen := s.E.Mutations(), s.E.LayerChanges()
	if !look && !w.layersRetry && !running(prev) && mutations == w.usageMutations && gen == w.layersGen {
		return w.idleWait()
	}
	w.samples.Add(1)
	st := &enginev1.VolumeStatus{Name: s.Name, Size: s.E.Size(), Frontend: s.Frontend, Endpoint: s.Endpoint,
		EndpointKind: string(s.EndpointKind), Socket: s.Socket, Fallback: s.Fallback,
		Robustness: s.E.Robustness(), Epoch: s.E.Epoch(), Replicas: s.replicas(), Rebuilds: s.rebuilds(), Clone: s.cloneStatus()}
	w.mu.Lock()
	stale := w.usageStale
	w.usageStale = false
	w.mu.Unlock()
	// Without a new answer from a replica the status keeps the snapshots
	// and data bytes it had.
	st.Snapshots = prev.GetSnapshots()
	if prev != nil {
		st.ActualSize = prev.ActualSize
	}
	st.Seq = prev.GetSeq()
	now := time.Now()
	if stale || w.layersRetry || prev == nil || gen != w.layersGen ||
		(mutations != w.usageMutations && now.Sub(w.usageAt) >= usageInterval) {
		s.sampleLayers(ctx, st, stale, now, mutations, gen)
	}
	if prev == nil || !proto.Equal(st, prev) {
		st.Seq++
		w.mu.Lock()
		w.latest = st
		close(w.updated)
		w.updated = make(chan struct{})
		w.mu.Unlock()
	}
	switch {
	case running(st) || w.layersRetry:
		return watchInterval
	case mutations != w.usageMutations:
		return max(w.usageAt.Add(usageInterval).Sub(now), watchInterval)
	}
	return w.idleWait()
}

// idleWait is how long the sampler sleeps when nothing runs.
func (w *watchers) idleWait() time.Duration {
	if w.idle > 0 {
		return w.idle
	}
	return usageInterval
}

// running reports whether st shows a rebuild or a clone in progress.
func running(st *enginev1.VolumeStatus) bool {
	if st.GetClone().GetState() == string(engine.RebuildInProgress) {
		return true
	}
	for _, rb := range st.GetRebuilds() {
		if rb.GetState() == string(engine.RebuildInProgress) {
			return true
		}
	}
	return false
}

// sampleLayers asks a replica for the snapshots and, when due, the data
// bytes, and puts them in st (under sampling). stale: a call through this
// server may have changed them. The data bytes are due after a call or a
// layer change, and otherwise usageInterval after they were last taken;
// the writes they count are those before the Mutations they were taken
// at, so writes made meanwhile bring the next ask.
func (s *Server) sampleLayers(ctx context.Context, st *enginev1.VolumeStatus, stale bool, now time.Time, mutations, gen uint64) {
	w := &s.watch
	w.asks.Add(1)
	sctx, cancel := context.WithTimeout(ctx, snapshotTimeout)
	info, err := s.E.LayerInfo(sctx)
	cancel()
	if err != nil {
		// No RW replica, or it did not answer: ask again at the next
		// sample, and take the data bytes then if this one was to.
		w.layersRetry = true
		if stale {
			w.mu.Lock()
			w.usageStale = true
			w.mu.Unlock()
		}
		return
	}
	st.Snapshots = snapshotsOut(info.Snapshots)
	if stale || gen != w.layersGen || w.usageAt.IsZero() || now.Sub(w.usageAt) >= usageInterval {
		n := info.HeadBytes
		for _, sn := range info.Snapshots {
			n += sn.DataBytes
		}
		st.ActualSize = &n
		w.usageAt, w.usageMutations = now, mutations
	}
	w.layersRetry, w.layersGen = false, gen
}
