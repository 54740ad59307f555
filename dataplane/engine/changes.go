package engine

import (
	"sync"
	"sync/atomic"
)

// changes tells whoever watches the engine's state (the control API's
// status stream) that what the engine exports may have changed: a
// replica's mode or the set of members, the epoch, the size, a rebuild or
// a clone starting or ending. The progress of a running rebuild or clone
// is not signalled; a watcher looks at it on its own while one runs. With
// it an idle engine that is watched needs no timer to stay current.
type changes struct {
	mu sync.Mutex
	ch chan struct{} // closed at the next change; nil until asked for
	// layers is LayerChanges.
	layers atomic.Uint64
}

// LayerChanges counts the engine's calls and copies that may have changed
// the replicas' layers or the data they hold other than by the volume's
// writes (a snapshot taken, deleted or reverted to, the volume grown, a
// rebuild or clone ended), its own rebuild snapshots included, so that a
// watcher knows when to ask a replica for them again. Each also signals
// Changed.
func (e *Engine) LayerChanges() uint64 { return e.changes.layers.Load() }

func (e *Engine) layersChanged() {
	e.changes.layers.Add(1)
	e.changed()
}

// Changed returns a channel closed at the engine's next change. Take it
// before reading the state, so that a change made while reading is not
// missed.
func (e *Engine) Changed() <-chan struct{} {
	c := &e.changes
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ch == nil {
		c.ch = make(chan struct{})
	}
	return c.ch
}

// changed wakes the watchers of Changed. Safe under e.mu.
func (e *Engine) changed() {
	c := &e.changes
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ch != nil {
		close(c.ch)
		c.ch = nil
	}
}
