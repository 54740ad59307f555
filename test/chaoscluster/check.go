//go:build chaoscluster

package chaoscluster

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	cairnv1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// The bounds the checker holds the cluster to (scaled by
// CAIRN_TEST_DEADLINE_SCALE). docs/reliability.md states them.
const (
	// healthyBound: every volume is attached and healthy again within this
	// time after a fault was healed (after a node started again: after it
	// serves again).
	healthyBound = 5 * time.Minute
	// progressBound: every workload does new work within this time once
	// its volume is healthy; else the volume is stuck.
	progressBound = 2 * time.Minute
	// rolloutBound: a DaemonSet's rolling restart completes within this.
	rolloutBound = 12 * time.Minute
	// goneBound: once the claims are deleted, their volumes, processes and
	// data directories are gone within this.
	goneBound = 4 * time.Minute
)

// volumes reads the workloads' Volume objects, by name.
func (r *runner) volumes(ctx context.Context) (map[string]cairnv1.Volume, error) {
	var list cairnv1.VolumeList
	if err := r.c.getJSON(ctx, &list, "-n", cairnNS, "volumes.storage.cairn.io"); err != nil {
		return nil, err
	}
	out := map[string]cairnv1.Volume{}
	for _, v := range list.Items {
		out[v.Name] = v
	}
	return out, nil
}

// waitHealthy waits until every workload's volume is attached and
// healthy, and returns how long that took.
func (r *runner) waitHealthy(ctx context.Context, bound time.Duration) (time.Duration, error) {
	start := time.Now()
	err := poll(ctx, bound, 2*time.Second, func() (bool, error) {
		vols, err := r.volumes(ctx)
		if err != nil {
			return false, err
		}
		var bad []string
		for _, w := range r.workloads {
			v, ok := vols[w.volume]
			switch {
			case !ok:
				bad = append(bad, w.volume+" missing")
			case v.Status.State != cairnv1.VolumeStateAttached || v.Status.Robustness != cairnv1.VolumeRobustnessHealthy:
				bad = append(bad, fmt.Sprintf("%s %s/%s", w.volume, v.Status.State, v.Status.Robustness))
			}
		}
		if len(bad) > 0 {
			return false, fmt.Errorf("not healthy: %s", strings.Join(bad, ", "))
		}
		return true, nil
	})
	return time.Since(start), err
}

// deleteWorkloads deletes the run's pods and claims and waits until their
// volumes are gone; it returns the replicas' data directories per node as
// they were before, for the orphan check.
func (r *runner) deleteWorkloads(ctx context.Context) (map[string][]string, error) {
	c := r.c
	dirs := map[string][]string{}
	var reps cairnv1.ReplicaList
	if err := c.getJSON(ctx, &reps, "-n", cairnNS, "replicas.storage.cairn.io"); err == nil {
		for _, rep := range reps.Items {
			if r.ours(rep.Spec.VolumeName) && rep.Spec.DataDirectoryName != "" {
				dirs[rep.Spec.NodeName] = append(dirs[rep.Spec.NodeName], rep.Spec.DataDirectoryName)
			}
		}
	}
	if _, err := c.kubectlFor(ctx, 6*time.Minute, "delete", "namespace", workNS, "--ignore-not-found", "--wait=true", "--timeout=5m"); err != nil {
		return dirs, err
	}
	err := poll(ctx, goneBound, 2*time.Second, func() (bool, error) {
		vols, err := r.volumes(ctx)
		if err != nil {
			return false, err
		}
		var left []string
		for _, w := range r.workloads {
			if v, ok := vols[w.volume]; ok {
				left = append(left, fmt.Sprintf("%s (%s)", w.volume, v.Status.State))
			}
		}
		return len(left) == 0, fmt.Errorf("volumes not deleted: %s", strings.Join(left, ", "))
	})
	return dirs, err
}

// ours reports whether vol is one of the run's volumes.
func (r *runner) ours(vol string) bool {
	for _, w := range r.workloads {
		if w.volume != "" && w.volume == vol {
			return true
		}
	}
	return false
}

// orphans waits until nothing of the run's volumes is left and no
// process or data directory on any node belongs to no object, and lists
// what is left if that does not happen within goneBound.
func (r *runner) orphans(ctx context.Context, dirs map[string][]string) []string {
	var found []string
	_ = poll(ctx, goneBound, 3*time.Second, func() (bool, error) {
		found = r.findOrphans(ctx, dirs)
		return len(found) == 0, nil
	})
	return found
}

// findOrphans lists, once: processes in an InstanceManager's status that
// are named after no Engine or Replica; engine or replica processes on a
// node with one of the run's volumes in their command line; data
// directories under dataDir that no Replica owns (and the run's in
// particular).
func (r *runner) findOrphans(ctx context.Context, dirs map[string][]string) []string {
	c := r.c
	owned, ownedDirs, err := r.objects(ctx)
	if err != nil {
		return []string{"reading objects: " + err.Error()}
	}
	var found []string
	var ims cairnv1.InstanceManagerList
	if err := c.getJSON(ctx, &ims, "-n", cairnNS, "instancemanagers.storage.cairn.io"); err != nil {
		return []string{"reading instance managers: " + err.Error()}
	}
	for _, im := range ims.Items {
		for _, p := range im.Status.Processes {
			if !owned[p.Name] {
				found = append(found, fmt.Sprintf("process %s (%s, %s) in %s's status belongs to no Engine or Replica", p.Name, p.Kind, p.State, im.Name))
			}
		}
	}
	for _, n := range c.nodes {
		found = append(found, r.nodeOrphans(ctx, n, ownedDirs, dirs[n])...)
	}
	sort.Strings(found)
	return found
}

// objects lists the names of every Engine and Replica and the data
// directories the Replicas own.
func (r *runner) objects(ctx context.Context) (names map[string]bool, dirs map[string]bool, err error) {
	var engs cairnv1.EngineList
	var reps cairnv1.ReplicaList
	if err := r.c.getJSON(ctx, &engs, "-n", cairnNS, "engines.storage.cairn.io"); err != nil {
		return nil, nil, err
	}
	if err := r.c.getJSON(ctx, &reps, "-n", cairnNS, "replicas.storage.cairn.io"); err != nil {
		return nil, nil, err
	}
	names, dirs = map[string]bool{}, map[string]bool{}
	for _, e := range engs.Items {
		names[e.Name] = true
	}
	for _, rep := range reps.Items {
		names[rep.Name] = true
		dirs[rep.Spec.DataDirectoryName] = true
	}
	return names, dirs, nil
}

// nodeOrphans lists one node's leftovers: processes of the run's volumes
// (read from /proc inside the node's container, which sees its pods'
// processes) and directories under dataDir no Replica owns.
func (r *runner) nodeOrphans(ctx context.Context, node string, ownedDirs map[string]bool, ourDirs []string) []string {
	c := r.c
	var found []string
	procs, err := c.nodeExec(ctx, node, `for p in /proc/[0-9]*; do a=$(tr '\0' ' ' < $p/cmdline 2>/dev/null); case "$a" in *cairn-data\ engine*|*cairn-data\ replica*) echo "${p#/proc/} $a";; esac; done`)
	if err != nil {
		return []string{fmt.Sprintf("listing processes on %s: %v", node, err)}
	}
	for _, line := range strings.Split(procs, "\n") {
		for _, w := range r.workloads {
			if w.volume != "" && strings.Contains(line, w.volume) {
				found = append(found, fmt.Sprintf("process on %s of deleted volume %s: %s", node, w.volume, line))
			}
		}
	}
	ls, err := c.nodeExec(ctx, node, "ls -A "+dataDir+" 2>/dev/null; true")
	if err != nil {
		return append(found, fmt.Sprintf("listing %s on %s: %v", dataDir, node, err))
	}
	for _, d := range strings.Fields(ls) {
		if !ownedDirs[d] {
			found = append(found, fmt.Sprintf("%s/%s on %s belongs to no Replica", dataDir, d, node))
		}
	}
	present := map[string]bool{}
	for _, d := range strings.Fields(ls) {
		present[d] = true
	}
	for _, d := range ourDirs {
		if present[d] && ownedDirs[d] {
			found = append(found, fmt.Sprintf("%s/%s on %s of a deleted volume is still owned by a Replica", dataDir, d, node))
		}
	}
	return found
}
