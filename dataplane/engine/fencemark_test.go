package engine

import "testing"

// TestKeptFor: a returning replica last a member at epoch E may copy
// dirty regions only from a source that has kept its bits since E+1 or
// earlier; a source with no record, or one from later, cannot vouch.
func TestKeptFor(t *testing.T) {
	for _, c := range []struct {
		kept, epoch uint64
		ok          bool
	}{
		{kept: 0, epoch: 5, ok: false},
		{kept: 6, epoch: 5, ok: true},
		{kept: 4, epoch: 5, ok: true},
		{kept: 7, epoch: 5, ok: false},
		{kept: 1, epoch: 0, ok: true},
	} {
		ok, why := keptFor(ReplicaInfo{DirtyKeptSince: c.kept}, ReplicaInfo{Epoch: c.epoch})
		if ok != c.ok || (why == "") != ok {
			t.Errorf("kept since %d, replica epoch %d: %v %q, want %v", c.kept, c.epoch, ok, why, c.ok)
		}
	}
}
