package volume

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// The planRepair cases' clock and replenishment wait.
var planNow = time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)

const planWait = time.Minute

const mRW, mWO, mERR = v1.ReplicaModeRW, v1.ReplicaModeWO, v1.ReplicaModeERR

type planModes = map[string]v1.ReplicaMode

func planAt(ago time.Duration) *metav1.Time { return &metav1.Time{Time: planNow.Add(-ago)} }

func planAddr(n string) v1.ReplicaAddress {
	return v1.ReplicaAddress{Data: n + ":1", Control: n + ":2"}
}

func planOld(n string) v1.ReplicaAddress {
	return v1.ReplicaAddress{Data: n + ":old", Control: n + ":old2"}
}

// planRep builds a replica: running (with its current address) or not,
// healthy before or not, failed `failed` ago (0: not failed).
func planRep(n string, running, wasHealthy bool, failed time.Duration) *v1.Replica {
	r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: n}}
	if running {
		r.Status.InstanceState, r.Status.Address, r.Status.ControlAddress = v1.InstanceStateRunning, n+":1", n+":2"
	}
	if wasHealthy {
		r.Spec.HealthyAt = planAt(time.Hour)
	}
	if failed > 0 {
		r.Spec.FailedAt = planAt(failed)
	}
	return r
}

// planRepairCases are TestPlanRepair's table, at package level so that
// each case's check is a function of its own rather than a branch of
// the test.
var planRepairCases = []struct {
	name  string
	in    repairInput
	addrs []string // names in the engine's set
	check func(t *testing.T, p repairPlan)
}{{
	name:  "healthy: nothing to do, addresses kept as the engine knows them",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 0)}, modes: planModes{"a": mRW, "b": mRW}, engineAddrs: map[string]v1.ReplicaAddress{"a": planOld("a"), "b": planAddr("b")}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.failed)+len(p.healthy)+p.replace+len(p.remove) != 0 || p.faulted || p.addresses["a"] != planOld("a") {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "first RW: marked healthy",
	in:    repairInput{want: 1, replicas: []*v1.Replica{planRep("a", true, false, 0)}, modes: planModes{"a": mRW}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.healthy) != 1 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "ERR and running again: marked failed and given back",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 0)}, modes: planModes{"a": mRW, "b": mERR}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.failed) != 1 || p.failed[0] != "b" || p.recheckAfter != planWait || p.replace != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "ERR and not running: failed, left out, no replacement yet",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", false, true, 10*time.Second)}, modes: planModes{"a": mRW, "b": mERR}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.failed) != 0 || p.replace != 0 || p.recheckAfter != 50*time.Second || p.rw != 1 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "gone from the engine after serving: failed",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", false, true, 0)}, modes: planModes{"a": mRW}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.failed) != 1 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "new replica never served: not failed, added",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("n", true, false, 0)}, modes: planModes{"a": mRW}},
	addrs: []string{"a", "n"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.failed) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "failed past the wait: replaced, kept until the replacement is RW, even if running again",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 2*time.Minute), planRep("c", true, false, 0)},
		modes: planModes{"a": mRW, "b": mERR, "c": mWO}},
	addrs: []string{"a", "c"},
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 0 || len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "failed past the wait, its replacement unplaced: given back when it runs again (a delta resync)",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 2*time.Minute), planRep("c", false, false, 0)},
		modes: planModes{"a": mRW}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 0 || len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "the given-back replica RW again: the replacement that never held data is surplus",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 0), planRep("c", false, false, 0)},
		modes: planModes{"a": mRW, "b": mRW}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.remove) != 1 || p.remove[0] != "c" || p.replace != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "failed past the wait, running, while its placed replacement rebuilds: not given back",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 2*time.Minute), planRep("c", true, false, 0)},
		modes: planModes{"a": mRW, "c": mWO}},
	addrs: []string{"a", "c"},
}, {
	name:  "a new replica while the engine has fewer RW than wanted is not surplus",
	in:    repairInput{want: 3, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 0), planRep("c", false, false, 0)}, modes: planModes{"a": mRW, "b": mRW}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "failed past the wait, no replacement yet: one is asked for",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", false, true, 2*time.Minute)}, modes: planModes{"a": mRW, "b": mERR}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 1 || len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "replacement RW: the expired replica is removed",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", false, true, 2*time.Minute), planRep("c", true, true, 0)}, modes: planModes{"a": mRW, "c": mRW}},
	addrs: []string{"a", "c"},
	check: func(t *testing.T, p repairPlan) {
		if len(p.remove) != 1 || p.remove[0] != "b" || p.replace != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "one rebuild at a time: a second candidate waits while one is WO",
	in: repairInput{want: 3, rebuildLimit: 1, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 20*time.Second), planRep("c", true, true, 10*time.Second)},
		modes: planModes{"a": mRW, "b": mWO, "c": mERR}},
	addrs: []string{"a", "b"},
}, {
	name: "limit 1, two candidates, none WO: the one failed longest goes first",
	in: repairInput{want: 3, rebuildLimit: 1, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("c", true, true, 10*time.Second), planRep("b", true, true, 20*time.Second)},
		modes: planModes{"a": mRW, "b": mERR, "c": mERR}},
	addrs: []string{"a", "b"},
}, {
	name: "limit 1: a candidate the engine was given keeps the slot over one failed longer",
	in: repairInput{want: 3, rebuildLimit: 1, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 20*time.Second), planRep("c", true, true, 10*time.Second)},
		modes: planModes{"a": mRW, "b": mERR, "c": mERR}, engineAddrs: map[string]v1.ReplicaAddress{"a": planAddr("a"), "c": planAddr("c")}},
	addrs: []string{"a", "c"},
}, {
	name: "faulted: every running replica, expired or not, goes to the engine to be reopened by epoch",
	in: repairInput{want: 3, rebuildLimit: 1, replicas: []*v1.Replica{planRep("a", true, true, 30*time.Second), planRep("b", true, true, 2*time.Minute), planRep("c", false, true, 30*time.Second)},
		modes: planModes{"a": mERR, "b": mERR, "c": mERR}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if !p.faulted || len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "a replica being deleted is not given to the engine and not counted",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), func() *v1.Replica {
		r := planRep("b", true, true, 0)
		r.DeletionTimestamp = planAt(time.Second)
		return r
	}()}, modes: planModes{"a": mRW}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 1 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "nothing yet: numberOfReplicas are created",
	in:    repairInput{want: 3},
	addrs: nil,
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 3 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "faulted: a given-up replica still counts, as there is nothing to rebuild a replacement from",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 30*time.Second), planRep("b", false, true, 2*time.Minute)}, modes: planModes{"a": mERR, "b": mERR}},
	addrs: []string{"a"},
	check: func(t *testing.T, p repairPlan) {
		if !p.faulted || p.replace != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "the engine does not run: a given-up replica still counts (a replacement would be an empty replica an attach waits for)",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", false, true, 0), planRep("b", false, true, 2*time.Minute)}},
	addrs: nil,
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 0 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name: "the engine does not run: a replica being deleted is replaced",
	in: repairInput{want: 2, replicas: []*v1.Replica{planRep("a", false, true, 0), func() *v1.Replica {
		r := planRep("b", false, true, 0)
		r.DeletionTimestamp = planAt(time.Second)
		return r
	}()}},
	addrs: nil,
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 1 {
			t.Fatalf("%+v", p)
		}
	},
}, {
	name:  "a given-up replica the engine rebuilds (WO) still counts: not replaced, not removed",
	in:    repairInput{want: 2, replicas: []*v1.Replica{planRep("a", true, true, 0), planRep("b", true, true, 2*time.Minute)}, modes: planModes{"a": mRW, "b": mWO}},
	addrs: []string{"a", "b"},
	check: func(t *testing.T, p repairPlan) {
		if p.replace != 0 || len(p.remove) != 0 {
			t.Fatalf("%+v", p)
		}
	},
}}

func TestPlanRepair(t *testing.T) {
	for _, tc := range planRepairCases {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.now, tc.in.wait = planNow, planWait
			if tc.in.rebuildLimit == 0 {
				tc.in.rebuildLimit = 1
			}
			p := planRepair(tc.in)
			var got []string
			for n := range p.addresses {
				got = append(got, n)
			}
			if len(got) != len(tc.addrs) {
				t.Fatalf("engine set %v, want %v", got, tc.addrs)
			}
			for _, n := range tc.addrs {
				if _, ok := p.addresses[n]; !ok {
					t.Fatalf("engine set %v, want %v", got, tc.addrs)
				}
			}
			if tc.check != nil {
				tc.check(t, p)
			}
		})
	}
}

// TestPlanReplicasEngineModes: the engine's replica modes are facts only
// while its process runs. A stopped engine's last reported modes (an RW
// replica) must not let a given-up replica be replaced: nothing would
// rebuild the replacement.
func TestPlanReplicasEngineModes(t *testing.T) {
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	r := &Reconciler{ReplenishmentWait: time.Minute}
	for _, tc := range []struct {
		state   v1.InstanceState
		replace int
	}{
		{v1.InstanceStateRunning, 1},
		{v1.InstanceStateStopped, 0},
		{v1.InstanceStateError, 0},
		{"", 0},
	} {
		s := &scope{now: now,
			v: &v1.Volume{Spec: v1.VolumeSpec{NumberOfReplicas: 2}},
			engine: &v1.Engine{Status: v1.EngineStatus{InstanceState: tc.state,
				ReplicaModeMap: map[string]v1.ReplicaMode{"a": v1.ReplicaModeRW, "b": v1.ReplicaModeERR}}},
			replicas: []*v1.Replica{
				{ObjectMeta: metav1.ObjectMeta{Name: "a"}, Spec: v1.ReplicaSpec{HealthyAt: &metav1.Time{Time: now.Add(-time.Hour)}}},
				{ObjectMeta: metav1.ObjectMeta{Name: "b"}, Spec: v1.ReplicaSpec{HealthyAt: &metav1.Time{Time: now.Add(-time.Hour)}, FailedAt: &metav1.Time{Time: now.Add(-2 * time.Minute)}}},
			}}
		if err := r.planReplicas(context.Background(), s); err != nil {
			t.Fatal(err)
		}
		if s.plan.replace != tc.replace {
			t.Errorf("engine %q: replace %d, want %d (%+v)", tc.state, s.plan.replace, tc.replace, s.plan)
		}
	}
}

// TestPlanRepairLocalAddress: a replica given to the engine reaches it
// through its unix socket when both run on one node and at its TCP
// address from elsewhere; one the engine holds stays at the address the
// engine knows it by, whichever that is (an engine started before its
// replicas had a socket is not made to rebuild them).
func TestPlanRepairLocalAddress(t *testing.T) {
	onNode := func(r *v1.Replica, node string) *v1.Replica {
		r.Spec.NodeName = node
		r.Status.LocalAddress = "unix:/run/cairn/r-" + r.Name + ".sock"
		return r
	}
	local := onNode(planRep("local", true, true, 0), "n1")
	remote := onNode(planRep("remote", true, true, 0), "n2")
	held := onNode(planRep("held", true, true, 0), "n1")
	back := onNode(planRep("back", true, true, 2*time.Second), "n1") // failed, running again: given back
	p := planRepair(repairInput{want: 4, replicas: []*v1.Replica{local, remote, held, back}, engineNode: "n1", rebuildLimit: 3,
		modes:       planModes{"held": mRW, "back": mERR},
		engineAddrs: map[string]v1.ReplicaAddress{"held": planAddr("held"), "back": planAddr("back")},
		now:         planNow, wait: planWait})
	for name, want := range map[string]v1.ReplicaAddress{
		"local":  {Data: "unix:/run/cairn/r-local.sock", Control: "local:2"},
		"remote": planAddr("remote"),
		"held":   planAddr("held"),
		"back":   {Data: "unix:/run/cairn/r-back.sock", Control: "back:2"},
	} {
		if got, ok := p.addresses[name]; !ok || got != want {
			t.Errorf("replica %s given at %+v (in the set: %v), want %+v", name, got, ok, want)
		}
	}

	// The engine on another node reaches every replica over TCP.
	p = planRepair(repairInput{want: 2, replicas: []*v1.Replica{local, remote}, engineNode: "n3", rebuildLimit: 2, now: planNow, wait: planWait})
	for _, name := range []string{"local", "remote"} {
		if got := p.addresses[name]; got != planAddr(name) {
			t.Errorf("engine on n3: replica %s given at %+v, want %+v", name, got, planAddr(name))
		}
	}
}
