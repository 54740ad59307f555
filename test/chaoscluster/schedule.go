//go:build chaoscluster

// Package chaoscluster runs whole-stack fault schedules on the e2e kind
// cluster (`make chaos-cluster SCHEDULES=N SEED=S`): workload pods that
// write checksummed, fsynced records and run fio with --verify on a raw
// block volume, a nemesis that breaks Cairn's pods, processes, nodes and
// network in an order drawn from a seed, and a checker that proves no
// acknowledged write was lost, every volume healthy again within a stated
// bound, and nothing left behind. docs/reliability.md, "Cluster fault
// schedules".
package chaoscluster

import (
	"fmt"
	"math/rand/v2"
	"time"
)

// Fault is a kind of fault the nemesis injects into the cluster.
type Fault string

// Faults.
const (
	// FaultIMDeleteApp deletes the instance-manager pod of the node the
	// workloads (and their engines) run on.
	FaultIMDeleteApp Fault = "im-delete-app"
	// FaultIMDeleteOther deletes the instance-manager pod of a node that
	// holds only replicas of the workloads' volumes.
	FaultIMDeleteOther Fault = "im-delete-other"
	// FaultKillEngine SIGKILLs the engine process of one workload's volume
	// (kubectl exec into its instance manager: pkill).
	FaultKillEngine Fault = "kill-engine"
	// FaultDeleteManager deletes the cairn-manager pod.
	FaultDeleteManager Fault = "delete-manager"
	// FaultDeleteCSIController deletes the CSI controller pod.
	FaultDeleteCSIController Fault = "delete-csi-controller"
	// FaultDeleteCSINode deletes the CSI node plugin pod of a node (which
	// also runs that node's device keeper).
	FaultDeleteCSINode Fault = "delete-csi-node"
	// FaultStopNode stops a worker node's container (docker stop), as a
	// power failure stops a machine, and starts it again after the hold.
	FaultStopNode Fault = "stop-node"
	// FaultCutNetwork drops every packet on a worker node's link to the
	// other nodes (iptables inside the kind node) for the hold.
	FaultCutNetwork Fault = "cut-network"
	// FaultFillDisk writes a ballast file into a node's replica data
	// directory for the hold (bounded: the kind nodes share the host's
	// disk; docs/reliability.md says what this does and does not reach).
	FaultFillDisk Fault = "fill-disk"
	// FaultRolloutRestart rolls a DaemonSet (instance manager or CSI node
	// plugin) with kubectl rollout restart and waits until it has rolled.
	FaultRolloutRestart Fault = "rollout-restart"
)

// AllFaults lists every fault kind, in the order the draw indexes them.
var AllFaults = []Fault{FaultIMDeleteApp, FaultIMDeleteOther, FaultKillEngine, FaultDeleteManager,
	FaultDeleteCSIController, FaultDeleteCSINode, FaultStopNode, FaultCutNetwork, FaultFillDisk, FaultRolloutRestart}

// held reports whether the fault lasts for a hold and is then healed.
func (f Fault) held() bool {
	return f == FaultStopNode || f == FaultCutNetwork || f == FaultFillDisk
}

// controlOnly reports whether the fault touches only Cairn's control
// components (no process or replica of a volume): such a fault may
// overlap the next one.
func (f Fault) controlOnly() bool {
	return f == FaultDeleteManager || f == FaultDeleteCSIController
}

// Step is one fault of a schedule, drawn before the schedule starts.
type Step struct {
	Fault Fault
	// Pick chooses the target among the fault's candidates (modulo their
	// number; the candidates are sorted, so the same cluster resolves the
	// same step to the same target).
	Pick int
	// Gap is the time before the fault is injected.
	Gap time.Duration
	// Hold is how long a held fault lasts before it is healed.
	Hold time.Duration
	// Overlap starts the next step without waiting for every volume to be
	// healthy again; drawn only next to a control-only fault.
	Overlap bool
}

func (s Step) String() string {
	out := fmt.Sprintf("%s pick=%d gap=%s", s.Fault, s.Pick, s.Gap)
	if s.Fault.held() {
		out += fmt.Sprintf(" hold=%s", s.Hold)
	}
	if s.Overlap {
		out += " overlap"
	}
	return out
}

// Draw draws the schedule of seed: steps faults among kinds (AllFaults
// when empty). The same arguments always draw the same schedule.
func Draw(seed uint64, steps int, kinds []Fault) []Step {
	if len(kinds) == 0 {
		kinds = AllFaults
	}
	rng := rand.New(rand.NewPCG(seed, 0x6361697223)) // the second word only separates this stream from others of the same seed
	out := make([]Step, steps)
	for i := range out {
		out[i] = Step{
			Fault: kinds[rng.IntN(len(kinds))],
			Pick:  rng.IntN(1 << 16),
			Gap:   time.Duration(5+rng.IntN(11)) * time.Second,
			Hold:  time.Duration(15+rng.IntN(31)) * time.Second,
		}
	}
	for i := range out {
		next := i+1 < len(out) && out[i+1].Fault.controlOnly()
		if (out[i].Fault.controlOnly() || next) && rng.IntN(3) == 0 {
			out[i].Overlap = true
		}
	}
	return out
}

// ParseFaults reads a comma-separated list of fault kinds.
func ParseFaults(list []string) ([]Fault, error) {
	var out []Fault
	for _, s := range list {
		ok := false
		for _, f := range AllFaults {
			if Fault(s) == f {
				ok = true
			}
		}
		if !ok {
			return nil, fmt.Errorf("unknown fault %q (known: %v)", s, AllFaults)
		}
		out = append(out, Fault(s))
	}
	return out, nil
}
