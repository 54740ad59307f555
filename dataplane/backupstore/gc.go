package backupstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
)

// GCResult says what CollectGarbage did.
type GCResult struct {
	// Referenced is how many distinct blocks the manifests reference.
	Referenced int
	// Deleted and DeletedBytes are the unreferenced blocks removed.
	Deleted      int
	DeletedBytes int64
	// Young is how many unreferenced blocks were kept because they were
	// written less than Options.GCMinAge before the collection.
	Young int
	// ExpiredLeases is how many leases of dead operations were removed.
	ExpiredLeases int
}

// CollectGarbage deletes the volume's blocks that no manifest references.
//
// It takes the volume's gc lease and then looks at the other leases: if a
// backup or restore holds a live one it stops with ErrBusy and deletes
// nothing (try again later). Otherwise backups and restores that start
// meanwhile see its lease and wait for it, so nothing it deletes can be
// needed by them. Unreferenced blocks younger than Options.GCMinAge (by the
// target's clock) are kept as well. Expired leases are removed.
func (s *Store) CollectGarbage(ctx context.Context, vol string) (*GCResult, error) {
	if err := validName("volume", vol); err != nil {
		return nil, err
	}
	l, err := s.takeLease(ctx, vol, leaseGC, randomID())
	if err != nil {
		return nil, err
	}
	defer l.release()
	st, err := s.leases(ctx, vol, l)
	if err != nil {
		return nil, err
	}
	if len(st.live) > 0 {
		keys := make([]string, len(st.live))
		for i, o := range st.live {
			keys[i] = o.Key
		}
		return nil, fmt.Errorf("%w: live leases %s", ErrBusy, strings.Join(keys, ", "))
	}
	res := &GCResult{}
	for _, o := range st.expired {
		if err := s.delete(ctx, o.Key); err != nil {
			return nil, err
		}
		res.ExpiredLeases++
	}
	referenced, err := s.referencedBlocks(ctx, vol)
	if err != nil {
		return nil, err
	}
	res.Referenced = len(referenced)
	garbage, err := s.unreferencedBlocks(ctx, vol, referenced, st.now.Add(-s.opts.GCMinAge), res)
	if err != nil {
		return nil, err
	}
	if err := s.deleteBlocks(ctx, l, garbage, res); err != nil {
		return res, err
	}
	s.healIndex(ctx, vol)
	return res, nil
}

// referencedBlocks reads every manifest of the volume (the truth, not the
// index) and collects the hashes they reference.
func (s *Store) referencedBlocks(ctx context.Context, vol string) (map[Hash]bool, error) {
	names, err := s.manifestNames(ctx, vol)
	if err != nil {
		return nil, err
	}
	refs := map[Hash]bool{}
	for name := range names {
		m, err := s.readManifest(ctx, vol, name)
		if errors.Is(err, ErrBackupNotFound) {
			continue // deleted since the listing
		}
		if err != nil {
			// A manifest that cannot be read might reference anything:
			// collect nothing rather than guess.
			return nil, fmt.Errorf("reading manifest %s before collecting garbage: %w", name, err)
		}
		for _, b := range m.Blocks {
			refs[b.Hash] = true
		}
	}
	return refs, nil
}

// unreferencedBlocks lists the volume's blocks and returns those not in
// refs and written before cutoff. Objects under blocks/ whose name is not
// a block's are left alone.
func (s *Store) unreferencedBlocks(ctx context.Context, vol string, refs map[Hash]bool, cutoff time.Time, res *GCResult) ([]Object, error) {
	objs, err := s.list(ctx, blockPrefix(vol))
	if err != nil {
		return nil, err
	}
	var garbage []Object
	for _, o := range objs {
		rest := strings.TrimPrefix(o.Key, blockPrefix(vol))
		dir, name, ok := strings.Cut(rest, "/")
		h, valid := parseHash(name)
		if !ok || !valid || dir != name[:2] || refs[h] {
			continue
		}
		if !o.ModTime.Before(cutoff) {
			res.Young++
			continue
		}
		garbage = append(garbage, o)
	}
	return garbage, nil
}

// deleteBlocks deletes the garbage with Options.Concurrency workers,
// checking before each delete that the gc lease is still safely held.
func (s *Store) deleteBlocks(ctx context.Context, l *lease, garbage []Object, res *GCResult) error {
	g := newGroup(ctx)
	var next, deleted, bytes atomic.Int64
	for range s.opts.Concurrency {
		g.Go(func() error {
			for {
				i := next.Add(1) - 1
				if i >= int64(len(garbage)) {
					return nil
				}
				if err := s.guardedDelete(g.ctx, l, garbage[i].Key); err != nil {
					return err
				}
				deleted.Add(1)
				bytes.Add(garbage[i].Size)
			}
		})
	}
	err := g.Wait()
	res.Deleted, res.DeletedBytes = int(deleted.Load()), bytes.Load()
	return err
}

// guardedDelete deletes key, checking before every attempt that the lease
// is still safely held: an attempt lasts at most CallTimeout (at most a
// quarter of the lease duration), so no delete lands after others may
// have seen the lease expire.
func (s *Store) guardedDelete(ctx context.Context, l *lease, key string) error {
	return s.call(ctx, "delete", key, func(ctx context.Context) error {
		if err := l.check(); err != nil {
			return err
		}
		return s.target.Delete(ctx, key)
	})
}
