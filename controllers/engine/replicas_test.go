package engine

import (
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

func TestReplicaChanges(t *testing.T) {
	a := func(n string) v1.ReplicaAddress { return v1.ReplicaAddress{Data: n + ":1", Control: n + ":2"} }
	s := func(n string) string { return n + ":1," + n + ":2" }
	for _, tc := range []struct {
		name        string
		spec        map[string]v1.ReplicaAddress
		members     map[string]string // address -> mode
		rebuilding  []string
		givenBack   []string // Replica names the Volume reconciler gave back
		add, remove []string
	}{
		{"in step", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("y")}, map[string]string{s("x"): "RW", s("y"): "WO"}, nil, nil, nil, nil},
		{"new replica added", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("y")}, map[string]string{s("x"): "RW"}, nil, nil, []string{s("y")}, nil},
		{"ERR replica in the spec given back", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("y")}, map[string]string{s("x"): "RW", s("y"): "ERR"}, nil, []string{"r2"}, []string{s("y")}, nil},
		// Its failure not yet recorded: the spec's entry is the old one,
		// even if a restarted process serves at the same address again.
		{"ERR replica not given back left alone", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("y")}, map[string]string{s("x"): "RW", s("y"): "ERR"}, nil, nil, nil, nil},
		{"ERR replica being rebuilt left alone", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("y")}, map[string]string{s("x"): "RW", s("y"): "ERR"}, []string{s("y")}, []string{"r2"}, nil, nil},
		{"replica at a new address: old one removed, new one added", map[string]v1.ReplicaAddress{"r1": a("x"), "r2": a("z")}, map[string]string{s("x"): "RW", s("y"): "ERR"}, nil, nil, []string{s("z")}, []string{s("y")}},
		{"dropped from the spec: removed", map[string]v1.ReplicaAddress{"r1": a("x")}, map[string]string{s("x"): "RW", s("y"): "RW"}, nil, nil, nil, []string{s("y")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vs := &enginev1.VolumeStatus{}
			for addr, m := range tc.members {
				vs.Replicas = append(vs.Replicas, &enginev1.Replica{Address: addr, Mode: m})
			}
			for _, addr := range tc.rebuilding {
				vs.Rebuilds = append(vs.Rebuilds, &enginev1.Rebuild{Replica: addr, State: "in-progress"})
			}
			add, remove := replicaChanges(tc.spec, vs, func(name string) bool { return slices.Contains(tc.givenBack, name) })
			if !slices.Equal(add, tc.add) || !slices.Equal(remove, tc.remove) {
				t.Fatalf("add %v remove %v, want %v %v", add, remove, tc.add, tc.remove)
			}
		})
	}
}

func TestApplyWatchStatus(t *testing.T) {
	e := &v1.Engine{Spec: v1.EngineSpec{ReplicaAddresses: map[string]v1.ReplicaAddress{"r1": {Data: "x:1", Control: "x:2"}, "r2": {Data: "y:1", Control: "y:2"}}}}
	applyWatchStatus(e, &enginev1.VolumeStatus{Size: 8 << 20,
		Replicas: []*enginev1.Replica{{Address: "x:1,x:2", Mode: "RW"}, {Address: "y:1,y:2", Mode: "WO"}, {Address: "gone:1,gone:2", Mode: "ERR"}},
		Rebuilds: []*enginev1.Rebuild{
			{Replica: "y:1,y:2", Source: "x:1,x:2", State: "failed", StartedUnixNano: 1},
			{Replica: "y:1,y:2", Source: "x:1,x:2", State: "in-progress", BytesDone: 1 << 20, BytesTotal: 4 << 20, DirtyOnly: true, StartedUnixNano: 2},
		},
		Snapshots: []*enginev1.Snapshot{{Name: "s1", UserCreated: true, DataBytes: 4096}}, ActualSize: proto.Int64(12288)})
	st := e.Status
	if len(st.ReplicaModeMap) != 2 || st.ReplicaModeMap["r1"] != v1.ReplicaModeRW || st.ReplicaModeMap["r2"] != v1.ReplicaModeWO {
		t.Fatalf("modes %v", st.ReplicaModeMap)
	}
	rb := st.RebuildStatus["r2"]
	if rb.State != v1.RebuildStateInProgress || rb.Progress != 25 || !rb.DirtyOnly || rb.SourceReplica != "r1" {
		t.Fatalf("rebuild %+v", rb)
	}
	if st.Size.Value() != 8<<20 || !st.Snapshots["s1"].UserCreated || st.Snapshots["s1"].Size.Value() != 4096 {
		t.Fatalf("size %v snapshots %v", st.Size, st.Snapshots)
	}
	if st.ActualSize == nil || st.ActualSize.Value() != 12288 {
		t.Fatalf("actual size %v", st.ActualSize)
	}
	// A status without it (not sampled yet) keeps the last one known.
	applyWatchStatus(e, &enginev1.VolumeStatus{Size: 8 << 20})
	if e.Status.ActualSize == nil || e.Status.ActualSize.Value() != 12288 {
		t.Fatalf("actual size after a status without it: %v", e.Status.ActualSize)
	}
}

func TestNeedsClone(t *testing.T) {
	from := &v1.EngineCloneSource{Replica: "src-r-1", Address: "h:1", Snapshot: "s1"}
	clone := func(addr, snap, state string) *enginev1.Clone {
		return &enginev1.Clone{Source: addr, Snapshot: snap, State: state}
	}
	for _, tc := range []struct {
		name  string
		maint bool
		from  *v1.EngineCloneSource
		st    *enginev1.Clone
		want  bool
	}{
		{"nothing asked", true, nil, nil, false},
		{"a user's engine never copies", false, from, nil, false},
		{"not started", true, from, nil, true},
		{"in progress", true, from, clone("h:1", "s1", "in-progress"), false},
		{"complete", true, from, clone("h:1", "s1", "complete"), false},
		{"failed: again", true, from, clone("h:1", "s1", "failed"), true},
		{"another source replica", true, from, clone("h:9", "s1", "complete"), true},
		{"another snapshot", true, from, clone("h:1", "s0", "complete"), true},
	} {
		e := &v1.Engine{Spec: v1.EngineSpec{Maintenance: tc.maint, CloneFrom: tc.from}}
		if got := needsClone(e, tc.st); got != tc.want {
			t.Errorf("%s: needsClone = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestReplicaGivenBack(t *testing.T) {
	addr := v1.ReplicaAddress{Data: "h:1", Control: "h:2"}
	failed := &metav1.Time{Time: time.Unix(1, 0)}
	for _, tc := range []struct {
		name   string
		mutate func(*v1.Replica)
		want   bool
	}{
		{"failure recorded, running at the spec's address", func(*v1.Replica) {}, true},
		{"failure not recorded yet (the spec's entry is the old one)", func(r *v1.Replica) { r.Spec.FailedAt = nil }, false},
		{"not running", func(r *v1.Replica) {
			r.Status.InstanceState, r.Status.Address, r.Status.ControlAddress = v1.InstanceStateError, "", ""
		}, false},
		{"running at another data address", func(r *v1.Replica) { r.Status.Address = "h:3" }, false},
		{"running at another control address", func(r *v1.Replica) { r.Status.ControlAddress = "h:3" }, false},
		{"being deleted", func(r *v1.Replica) { r.DeletionTimestamp = failed }, false},
		{"its unix socket is the spec's data address", func(r *v1.Replica) { r.Status.Address, r.Status.LocalAddress = "h:3", "h:1" }, true},
		{"has a unix socket, the spec gives its TCP address", func(r *v1.Replica) { r.Status.LocalAddress = "unix:/r.sock" }, true},
	} {
		rep := &v1.Replica{Spec: v1.ReplicaSpec{FailedAt: failed},
			Status: v1.ReplicaStatus{InstanceState: v1.InstanceStateRunning, Address: "h:1", ControlAddress: "h:2"}}
		tc.mutate(rep)
		if got := replicaGivenBack(rep, addr); got != tc.want {
			t.Errorf("%s: replicaGivenBack = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestReplicaMismatch: an engine is started on a replica only when its
// process runs, on the node's current instance manager, at exactly the
// address the spec gives.
func TestReplicaMismatch(t *testing.T) {
	a := v1.ReplicaAddress{Data: "10.0.0.1:1", Control: "10.0.0.1:2"}
	rep := func(mut func(*v1.Replica)) *v1.Replica {
		r := &v1.Replica{Spec: v1.ReplicaSpec{NodeName: "n1"}}
		if mut != nil {
			mut(r)
		}
		return r
	}
	proc := func(state imv1.ProcessState, data, control string) *imv1.Process {
		return &imv1.Process{State: state, DataAddress: data, ControlAddress: control}
	}
	withSocket := func(p *imv1.Process, local string) *imv1.Process { p.LocalDataAddress = local; return p }
	local := v1.ReplicaAddress{Data: "unix:/run/cairn/r-1.sock", Control: a.Control}
	running := imv1.ProcessState_PROCESS_STATE_RUNNING
	for _, tc := range []struct {
		name  string
		seen  replicaSeen
		ok    bool
		given v1.ReplicaAddress // the spec's address ({}: a)
	}{
		{"runs where the spec says", replicaSeen{rep: rep(nil), current: true, proc: proc(running, a.Data, a.Control)}, true, v1.ReplicaAddress{}},
		{"no Replica", replicaSeen{}, false, v1.ReplicaAddress{}},
		{"being deleted", replicaSeen{rep: rep(func(r *v1.Replica) { r.DeletionTimestamp = &metav1.Time{Time: time.Now()} }), current: true, proc: proc(running, a.Data, a.Control)}, false, v1.ReplicaAddress{}},
		{"not placed", replicaSeen{rep: rep(func(r *v1.Replica) { r.Spec.NodeName = "" })}, false, v1.ReplicaAddress{}},
		{"its instance manager unreachable", replicaSeen{rep: rep(nil), unreachable: "instance manager im-n1 at x is not reachable", proc: proc(running, a.Data, a.Control)}, false, v1.ReplicaAddress{}},
		{"no process (a new instance manager)", replicaSeen{rep: rep(nil), current: true}, false, v1.ReplicaAddress{}},
		{"starting", replicaSeen{rep: rep(nil), current: true, proc: proc(imv1.ProcessState_PROCESS_STATE_STARTING, "", "")}, false, v1.ReplicaAddress{}},
		{"runs at a new pod IP", replicaSeen{rep: rep(nil), current: true, proc: proc(running, "10.0.0.9:1", "10.0.0.9:2")}, false, v1.ReplicaAddress{}},
		{"runs at another data port", replicaSeen{rep: rep(nil), current: true, proc: proc(running, "10.0.0.1:7", a.Control)}, false, v1.ReplicaAddress{}},
		{"serves a unix socket too; the spec gives its TCP address", replicaSeen{rep: rep(nil), current: true, proc: withSocket(proc(running, a.Data, a.Control), local.Data)}, true, v1.ReplicaAddress{}},
		{"the spec gives its unix socket", replicaSeen{rep: rep(nil), current: true, proc: withSocket(proc(running, a.Data, a.Control), local.Data)}, true, local},
		{"the spec gives a unix socket it does not serve", replicaSeen{rep: rep(nil), current: true, proc: withSocket(proc(running, a.Data, a.Control), "unix:/other.sock")}, false, local},
		{"the spec gives a unix socket, it serves none", replicaSeen{rep: rep(nil), current: true, proc: proc(running, a.Data, a.Control)}, false, local},
	} {
		t.Run(tc.name, func(t *testing.T) {
			given := a
			if tc.given.Data != "" {
				given = tc.given
			}
			why := replicaMismatch(given, tc.seen)
			if (why == "") != tc.ok {
				t.Fatalf("replicaMismatch = %q, want ok=%v", why, tc.ok)
			}
		})
	}
}

// A full rebuild of a returning replica carries the engine's reasons
// (why in full, why through the engine) into status, cut to the CRD's
// limit at a rune boundary.
func TestApplyWatchStatusFullReason(t *testing.T) {
	e := &v1.Engine{Spec: v1.EngineSpec{ReplicaAddresses: map[string]v1.ReplicaAddress{"r1": {Data: "x:1", Control: "x:2"}, "r2": {Data: "y:1", Control: "y:2"}}}}
	reason, relay := "history unknown: the engine restarted while it was away", "the replica cannot pull from the source: source x:2 cannot be read from this replica"
	applyWatchStatus(e, &enginev1.VolumeStatus{Size: 8 << 20,
		Replicas: []*enginev1.Replica{{Address: "x:1,x:2", Mode: "RW"}, {Address: "y:1,y:2", Mode: "WO"}},
		Rebuilds: []*enginev1.Rebuild{{Replica: "y:1,y:2", Source: "x:1,x:2", State: "in-progress", BytesTotal: 8 << 20, FullReason: reason, RelayReason: relay, StartedUnixNano: 1}}})
	if rb := e.Status.RebuildStatus["r2"]; rb.FullReason != reason || rb.RelayReason != relay || rb.DirtyOnly {
		t.Fatalf("rebuild %+v", rb)
	}
	long := strings.Repeat("é", 200) // 400 bytes
	applyWatchStatus(e, &enginev1.VolumeStatus{Size: 8 << 20,
		Replicas: []*enginev1.Replica{{Address: "x:1,x:2", Mode: "RW"}, {Address: "y:1,y:2", Mode: "WO"}},
		Rebuilds: []*enginev1.Rebuild{{Replica: "y:1,y:2", Source: "x:1,x:2", State: "in-progress", FullReason: long, RelayReason: long, StartedUnixNano: 1}}})
	for what, got := range map[string]string{"full": e.Status.RebuildStatus["r2"].FullReason, "relay": e.Status.RebuildStatus["r2"].RelayReason} {
		kept, marked := strings.CutSuffix(got, "...")
		if len(got) > maxFullReason || !utf8.ValidString(got) || !marked || !strings.HasPrefix(long, kept) || len(got) < maxFullReason-1 {
			t.Fatalf("cut %s reason: %d bytes, valid %v", what, len(got), utf8.ValidString(got))
		}
	}
}
