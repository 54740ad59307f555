package engine

import "testing"

// TestSafeToOpen walks the open rule: the volume is served without a
// replica that did not answer, or was not given, only when every replica
// named by the newest epoch's recorded RW set (and by later sets a
// rebuilding replica recorded) answered; without a recorded set, every
// replica given must.
func TestSafeToOpen(t *testing.T) {
	info := func(id string, epoch uint64, members ...string) ReplicaInfo {
		return ReplicaInfo{ID: id, Epoch: epoch, EpochMembers: members}
	}
	rebuilding := func(in ReplicaInfo) ReplicaInfo { in.Rebuilding = true; return in }
	for _, tc := range []struct {
		name       string
		infos      []ReplicaInfo
		unanswered int
		acceptLost bool
		ok         bool
	}{
		{"everyone answered, no set recorded", []ReplicaInfo{info("a", 0), info("b", 0)}, 0, false, true},
		{"everyone given answered, sets name them", []ReplicaInfo{info("a", 7, "a", "b"), info("b", 7, "a", "b")}, 0, false, true},
		// c was RW at 7 but the engine was not given its address.
		{"a member of the newest set not given", []ReplicaInfo{info("a", 7, "a", "b", "c"), info("b", 7, "a", "b", "c")}, 0, false, false},
		{"everyone given answered, none can serve", []ReplicaInfo{rebuilding(info("d", 8, "c"))}, 0, false, true},
		// d's fence recorded no set; a's still names c, not given.
		{"a set without a record does not hide a named member", []ReplicaInfo{info("a", 7, "a", "c"), rebuilding(info("d", 7))}, 0, false, false},
		{"a fresh volume with one replica missing", []ReplicaInfo{info("a", 0), info("b", 0)}, 1, false, false},
		{"nobody answered", nil, 2, false, false},
		{"set recorded by an older binary", []ReplicaInfo{info("a", 7), info("b", 7)}, 1, false, false},
		{"the missing one is not in the newest set", []ReplicaInfo{info("a", 7, "a", "b"), info("b", 7, "a", "b")}, 1, false, true},
		{"the missing one is in the newest set", []ReplicaInfo{info("a", 7, "a", "b", "c"), info("b", 7, "a", "b", "c")}, 1, false, false},
		// b was failed at 6 (its set still names c); a and c went on; c is
		// missing: a's set at 7 names c, so it may hold newer writes.
		{"newest set names the missing one, older ones do not matter", []ReplicaInfo{info("a", 7, "a", "c"), info("b", 6, "a", "b")}, 1, false, false},
		// a alone went on to 8 after b and c failed: b, c at 7 are stale.
		{"the survivor answered, the stale ones need not", []ReplicaInfo{info("a", 8, "a")}, 2, false, true},
		// a and b hold 7 naming c; c may have gone on alone.
		{"stale holders cannot speak for the one that went on", []ReplicaInfo{info("a", 7, "a", "b", "c"), info("b", 7, "a", "b", "c")}, 1, false, false},
		// The union of the sets at the newest epoch: b recorded a wider one
		// (the first round of a publication that c refused).
		{"union of the sets at the newest epoch", []ReplicaInfo{info("a", 7, "a", "b"), info("b", 7, "a", "b", "c")}, 1, false, false},
		// A member of the set that answered with an older epoch is known.
		{"a member that answered older is known", []ReplicaInfo{info("a", 7, "a", "b"), info("b", 6, "a", "b")}, 1, false, true},
		// A rebuilding replica fenced at 8 by an engine whose RW set was
		// {c}: c went on past a's epoch 7 and has not answered.
		{"a rebuilding replica names a newer set", []ReplicaInfo{info("a", 7, "a"), rebuilding(info("d", 8, "c"))}, 1, false, false},
		{"a rebuilding replica whose set answered", []ReplicaInfo{info("a", 7, "a"), rebuilding(info("d", 8, "a"))}, 1, false, true},
		{"only a rebuilding replica answered", []ReplicaInfo{rebuilding(info("d", 8, "d"))}, 1, false, false},
		// c's node was declared shut down: the caller accepts it lost.
		{"a member not given, declared lost", []ReplicaInfo{info("a", 7, "a", "b", "c"), info("b", 7, "a", "b", "c")}, 0, true, true},
		// Declaring lost the replicas not given says nothing of a given
		// one that does not answer: it may be c.
		{"declared lost, but a given one did not answer", []ReplicaInfo{info("a", 7, "a", "b", "c"), info("b", 7, "a", "b", "c")}, 1, true, false},
		{"declared lost, nobody answered", nil, 2, true, false},
		{"declared lost, only a rebuilding replica answered", []ReplicaInfo{rebuilding(info("d", 8, "c"))}, 0, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := safeToOpen(tc.infos, tc.unanswered, tc.acceptLost)
			if v.ok != tc.ok {
				t.Fatalf("safeToOpen = %v (%s), want %v", v.ok, v.why, tc.ok)
			}
			if !v.ok && v.why == "" {
				t.Fatal("refused without a reason")
			}
			if v.ok && !tc.acceptLost && len(v.lost) > 0 {
				t.Fatalf("lost %v without being allowed to", v.lost)
			}
		})
	}
}
