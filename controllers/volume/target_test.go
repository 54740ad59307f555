package volume

import "testing"

func TestRunTarget(t *testing.T) {
	nodes := []string{"n2", "n1"} // the running replica's node first
	for _, tc := range []struct {
		name  string
		in    runInput
		node  string
		maint bool
	}{
		{"nothing to do, no user: nothing runs", runInput{cloned: true, replicaNodes: nodes}, "", false},
		{"a user: the user's engine on the user's node", runInput{userNode: "u", cloned: true, replicaNodes: nodes}, "u", false},
		{"a user and snapshot work: the user's engine does it", runInput{userNode: "u", work: "taking snapshot s", cloned: true, replicaNodes: nodes}, "u", false},
		{"work, no user: maintenance on the first replica's node", runInput{work: "taking snapshot s", cloned: true, replicaNodes: nodes}, "n2", true},
		{"work, no user: stays where the maintenance engine runs", runInput{work: "w", cloned: true, replicaNodes: nodes, engineNode: "n1", engineMaintenance: true}, "n1", true},
		{"work, no user: a user's engine left on a replica node is not kept", runInput{work: "w", cloned: true, replicaNodes: nodes, engineNode: "n1"}, "n2", true},
		{"work, no user: a maintenance engine on a node without a replica moves", runInput{work: "w", cloned: true, replicaNodes: nodes, engineNode: "x", engineMaintenance: true}, "n2", true},
		{"work, but no replica placed: nowhere", runInput{work: "w", cloned: true}, "", false},
		{"clone not ready, no work: nothing runs, not even for a user", runInput{userNode: "u", replicaNodes: nodes}, "", false},
		{"clone ready, a user: copies on the user's node without a device", runInput{userNode: "u", cloneReady: true, replicaNodes: nodes}, "u", true},
		{"clone ready, no user: copies on a replica's node", runInput{cloneReady: true, replicaNodes: nodes}, "n2", true},
		{"clone not ready, snapshot deletions pending: maintenance", runInput{work: "deleting snapshot s", replicaNodes: nodes}, "n2", true},
		{"cloned, a user: the user's engine (restarted from maintenance)", runInput{userNode: "u", cloned: true, engineNode: "u", engineMaintenance: true, replicaNodes: nodes}, "u", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, maint := runTarget(tc.in)
			if node != tc.node || maint != tc.maint {
				t.Errorf("runTarget = %q, %v; want %q, %v", node, maint, tc.node, tc.maint)
			}
		})
	}
}
