package engineserver

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
)

// watchInterval is how often the server looks at the engine's state while
// a Watch stream is open. The engine tells nobody when its state changes,
// so the server samples what it exports (modes, rebuilds, snapshots, size)
// and sends a message only when that differs: the watchers never poll,
// and an unchanged volume sends them nothing. The server's own mutating
// calls (snapshot, expand, add...) have it look at once instead of at the
// next tick.
const watchInterval = 200 * time.Millisecond

// snapshotTimeout bounds the replica call that lists the snapshots in one
// sample; when it fails, the status keeps the snapshots it had.
const snapshotTimeout = 2 * time.Second

// usageInterval is how often a sample takes the replica's data bytes
// (VolumeStatus.actual_size) anew: they change with nearly every write to
// a new block, and each change is a status update the reconciler writes
// to the API server. A call through this server that may change them
// (snapshot, revert, expand...) has the next sample take them at once.
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
	// usageAt is when a sample last took the actual size (under
	// sampling).
	usageAt time.Time
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
	s.sample(ctx)
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
	t := time.NewTicker(watchInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-poke:
		}
		s.sample(ctx)
	}
}

// sample reads the engine's state and, if it differs from the latest
// status, publishes it with the next seq.
func (s *Server) sample(ctx context.Context) {
	w := &s.watch
	w.sampling.Lock()
	defer w.sampling.Unlock()
	prev, _ := w.current()
	st := &enginev1.VolumeStatus{Name: s.Name, Size: s.E.Size(), Frontend: s.Frontend, Endpoint: s.Endpoint,
		EndpointKind: string(s.EndpointKind), Socket: s.Socket, Fallback: s.Fallback,
		Robustness: s.E.Robustness(), Epoch: s.E.Epoch(), Replicas: s.replicas(), Rebuilds: s.rebuilds(), Clone: s.cloneStatus()}
	w.mu.Lock()
	stale := w.usageStale
	w.usageStale = false
	w.mu.Unlock()
	sctx, cancel := context.WithTimeout(ctx, snapshotTimeout)
	info, err := s.E.LayerInfo(sctx)
	cancel()
	// Without an answer (no RW replica, or it did not answer) the status
	// keeps what it had.
	st.Snapshots = prev.GetSnapshots()
	if prev != nil {
		st.ActualSize = prev.ActualSize
	}
	if err == nil {
		st.Snapshots = snapshotsOut(info.Snapshots)
		if stale || w.usageAt.IsZero() || time.Since(w.usageAt) >= usageInterval {
			n := info.HeadBytes
			for _, sn := range info.Snapshots {
				n += sn.DataBytes
			}
			st.ActualSize = &n
			w.usageAt = time.Now()
		}
	} else if stale {
		w.mu.Lock()
		w.usageStale = true // for the next sample that gets an answer
		w.mu.Unlock()
	}
	st.Seq = prev.GetSeq()
	if prev != nil && proto.Equal(st, prev) {
		return
	}
	st.Seq++
	w.mu.Lock()
	w.latest = st
	close(w.updated)
	w.updated = make(chan struct{})
	w.mu.Unlock()
}
