// Fenced: the chain changes as a caller of one epoch makes them.

package replica

// Fenced is the replica's changes to its chain and size as a caller of
// one epoch makes them: each is refused with a *StaleEpochError unless
// that epoch is the replica's current one, checked atomically with the
// change (see lockChain), as data requests are (ReadAtEpoch). A stale
// engine, one a newer engine has fenced out, can then no longer change
// the replica. The control API takes every change through here.
type Fenced struct {
	r     *Replica
	epoch uint64
}

// At returns the replica's changes as a caller of epoch makes them.
func (r *Replica) At(epoch uint64) Fenced { return Fenced{r: r, epoch: epoch} }

// Snapshot is Replica.Snapshot, fenced.
func (f Fenced) Snapshot(o SnapshotOptions) error { return f.r.snapshot(&f.epoch, o) }

// DeleteSnapshot is Replica.DeleteSnapshot, fenced when it starts: once
// admitted, a deletion runs to the end even if the epoch changes
// meanwhile. It changes no read, and the engine that asked for it can
// bump the epoch while it merges (another replica failing); in the case
// that rewrites the snapshot's layer, the intent is committed under the
// same hold as the check.
func (f Fenced) DeleteSnapshot(name string) error { return f.r.deleteSnapshotNamed(&f.epoch, name) }

// Revert is Replica.Revert, fenced.
func (f Fenced) Revert(name string) error { return f.r.revert(&f.epoch, name) }

// Expand is Replica.Expand, fenced.
func (f Fenced) Expand(size int64) error { return f.r.expand(&f.epoch, size) }

// ReplaceChain is Replica.ReplaceChain, fenced.
func (f Fenced) ReplaceChain(snaps []SnapshotInfo) error { return f.r.replaceChain(&f.epoch, snaps) }

// CheckLayerWrite reports what WriteLayer of length bytes at off into
// snapshot name would be refused for (a stale epoch, a closed replica, a
// missing snapshot, a range outside the volume or not block-aligned),
// without writing: a caller that must fetch the data first checks before
// it does.
func (f Fenced) CheckLayerWrite(name string, off, length int64) error {
	return f.r.locked(&f.epoch, func() error {
		_, err := f.r.snapshotSpan(name, off, length, "layer writes")
		return err
	})
}

// WriteLayer is Replica.WriteLayer, fenced.
func (f Fenced) WriteLayer(name string, p []byte, off int64) error {
	return f.r.writeLayer(&f.epoch, name, p, off)
}

// mergeState coordinates a snapshot deletion's copy with writes: every
// write (head, unmap, rebuild layer write) holds mu shared and records
// the blocks it wrote in touched (only when the child's blocks are copied
// into the snapshot's layer: they must be copied again); the copy holds
