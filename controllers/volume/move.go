package volume

import v1 "github.com/cairn-io/cairn/api/v1alpha1"

// LabelReplaces marks a replica created to take over from another replica
// of the same volume that is being moved off its node (a drain, or the
// StorageNode's spec.evictionRequested: controllers/drain). Its value is
// the name of the replica it replaces, which is deleted once this one is
// RW.
const LabelReplaces = "storage.cairn.io/replaces"

// moves returns, for the replicas being moved off their node, the name of
// each one's replacement (the replica labelled LabelReplaces with its
// name). Repair treats such a pair as one: the replacement is not surplus
// while the replica it replaces is there, and the replica it replaces is
// not a failure when it is deleted.
func moves(reps []*v1.Replica) map[string]string {
	names := map[string]bool{}
	for _, r := range reps {
		names[r.Name] = true
	}
	out := map[string]string{}
	for _, r := range reps {
		if old := r.Labels[LabelReplaces]; old != "" && names[old] {
			out[old] = r.Name
		}
	}
	return out
}
