//go:build chaoscluster

package chaoscluster

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// chaosChain is the iptables chain a network cut adds to a node; ballast
// is the file a disk fill writes. Both carry the harness's name, so that
// a leftover one is recognised (and removed) by the next run.
const (
	chaosChain = "CAIRN-CHAOS"
	dataDir    = "/var/lib/cairn/replicas"
	ballast    = dataDir + "/cairn-chaos-ballast"
)

// heals holds what undoes the faults that are in force: a node to start,
// a cut to mend, a ballast to remove. healAll runs them even when the
// schedule failed or was interrupted.
type heals struct {
	mu sync.Mutex
	m  map[string]func(context.Context) error
}

func (h *heals) add(key string, f func(context.Context) error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.m == nil {
		h.m = map[string]func(context.Context) error{}
	}
	h.m[key] = f
}

// heal runs the healer of key and forgets it once it succeeded (a
// healer that failed stays, for healAll at the end to try again). It
// runs on ctx's values without its cancellation: an interrupt must not
// leave a node stopped.
func (h *heals) heal(ctx context.Context, key string) error {
	h.mu.Lock()
	f := h.m[key]
	delete(h.m, key)
	h.mu.Unlock()
	if f == nil {
		return nil
	}
	if err := f(context.WithoutCancel(ctx)); err != nil {
		h.add(key, f)
		return fmt.Errorf("%s: %w", key, err)
	}
	return nil
}

// healAll runs every healer left.
func (h *heals) healAll(ctx context.Context) error {
	h.mu.Lock()
	var keys []string
	for k := range h.m {
		keys = append(keys, k)
	}
	h.mu.Unlock()
	var errs []error
	for _, k := range keys {
		errs = append(errs, h.heal(ctx, k))
	}
	return errors.Join(errs...)
}

// inject injects step's fault and returns its target. A held fault
// registers its healer; the caller heals it after the hold.
func (r *runner) inject(ctx context.Context, s Step) (target string, err error) {
	c := r.c
	switch s.Fault {
	case FaultIMDeleteApp:
		return r.appNode, r.deletePodOn(ctx, "instance-manager", r.appNode, true)
	case FaultIMDeleteOther:
		n := pick(s, r.replicaOnlyNodes())
		return n, r.deletePodOn(ctx, "instance-manager", n, true)
	case FaultDeleteCSINode:
		n := pick(s, c.nodes)
		return n, r.deletePodOn(ctx, "csi-node", n, false)
	case FaultDeleteManager, FaultDeleteCSIController:
		comp := map[Fault]string{FaultDeleteManager: "manager", FaultDeleteCSIController: "csi-controller"}[s.Fault]
		_, err := c.kubectl(ctx, "", "-n", cairnNS, "delete", "pod", "-l", "app.kubernetes.io/component="+comp, "--wait=false")
		return comp, err
	case FaultKillEngine:
		w := r.workloads[s.Pick%len(r.workloads)]
		return w.volume, r.killEngine(ctx, w.volume)
	case FaultStopNode:
		n := pick(s, r.replicaOnlyNodes())
		return n, r.stopNode(ctx, n)
	case FaultCutNetwork:
		n := pick(s, r.replicaOnlyNodes())
		return n, r.cutNetwork(ctx, n)
	case FaultFillDisk:
		n := pick(s, c.nodes)
		return n, r.fillDisk(ctx, n)
	case FaultRolloutRestart:
		ds := pick(s, []string{"cairn-csi-node", "cairn-instance-manager"})
		return ds, r.rolloutRestart(ctx, ds)
	}
	return "", fmt.Errorf("unknown fault %q", s.Fault)
}

// pick is step's choice among candidates.
func pick(s Step, candidates []string) string {
	return candidates[s.Pick%len(candidates)]
}

// replicaOnlyNodes are the workers without workloads: the nodes a stop or
// a network cut may take away (the app's node lost is the case of the
// out-of-service taint, which the e2e suite covers).
func (r *runner) replicaOnlyNodes() []string {
	var out []string
	for _, n := range r.c.workers() {
		if n != r.appNode {
			out = append(out, n)
		}
	}
	return out
}

// deletePodOn deletes component's pod on node and, if wait, waits until
// its replacement runs.
func (r *runner) deletePodOn(ctx context.Context, component, node string, wait bool) error {
	c := r.c
	old, err := c.podOn(ctx, component, node)
	if err != nil {
		return err
	}
	if old == "" {
		return fmt.Errorf("no %s pod on %s", component, node)
	}
	if _, err := c.kubectl(ctx, "", "-n", cairnNS, "delete", "pod", old, "--wait=false"); err != nil {
		return err
	}
	if !wait {
		return nil
	}
	return poll(ctx, 3*time.Minute, time.Second, func() (bool, error) {
		out, err := c.kubectl(ctx, "", "-n", cairnNS, "get", "pod", "-l", "app.kubernetes.io/component="+component,
			"--field-selector", "spec.nodeName="+node, "-o", `jsonpath={.items[?(@.status.phase=="Running")].metadata.name}`)
		return err == nil && out != "" && out != old, fmt.Errorf("no new %s pod running on %s (old %s, running %q)", component, node, old, out)
	})
}

// killEngine SIGKILLs the engine process of vol, from inside the
// instance-manager pod of the volume's node; where that image has no
// pkill, from the node (the same process namespace's view).
func (r *runner) killEngine(ctx context.Context, vol string) error {
	c := r.c
	node, err := c.kubectl(ctx, "", "-n", cairnNS, "get", "volumes.storage.cairn.io", vol, "-o", "jsonpath={.status.currentNodeName}")
	if err != nil {
		return err
	}
	if node == "" {
		return fmt.Errorf("volume %s has no current node", vol)
	}
	im, err := c.podOn(ctx, "instance-manager", node)
	if err != nil {
		return err
	}
	if im == "" {
		return fmt.Errorf("no instance-manager pod on %s", node)
	}
	// [c] keeps pkill from matching a shell whose command line holds the
	// pattern.
	pattern := fmt.Sprintf("[c]airn-data engine .*%s", vol)
	_, err = c.kubectl(ctx, "", "-n", cairnNS, "exec", im, "-c", "instance-manager", "--", "pkill", "-KILL", "-f", pattern)
	if err == nil {
		return nil
	}
	// kubectl exits 1 both when pkill found nothing and when the image
	// has no pkill: the node's own pkill tells the two apart.
	c.logf("    kubectl exec pkill in %s: %v; killing from the node", im, err)
	_, err = run(ctx, "", "docker", "exec", node, "pkill", "-KILL", "-f", pattern)
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() == 1 {
		return fmt.Errorf("no engine process of %s on %s", vol, node)
	}
	return err
}

// stopNode stops a worker's container and registers the healer that
// starts it again and waits until it serves again.
func (r *runner) stopNode(ctx context.Context, node string) error {
	if node == r.c.controlPlane {
		return fmt.Errorf("never the control plane: it holds the API server")
	}
	r.heals.add("stop "+node, func(ctx context.Context) error { return r.startNode(ctx, node) })
	_, err := run(ctx, "", "docker", "stop", node)
	return err
}

// startNode starts a stopped node and waits until it is Ready and its
// instance manager and CSI node plugin serve again.
func (r *runner) startNode(ctx context.Context, node string) error {
	if _, err := run(ctx, "", "docker", "start", node); err != nil {
		return err
	}
	return r.waitNodeServes(ctx, node)
}

// waitNodeServes waits until node is Ready and its instance manager
// reports running and its CSI node plugin pod is Ready.
func (r *runner) waitNodeServes(ctx context.Context, node string) error {
	c := r.c
	return poll(ctx, 4*time.Minute, 2*time.Second, func() (bool, error) {
		if s := c.nodeReady(ctx, node); s != "True" {
			return false, fmt.Errorf("node %s Ready=%q", node, s)
		}
		im, _ := c.kubectl(ctx, "", "-n", cairnNS, "get", "instancemanagers.storage.cairn.io", "im-"+node, "-o", "jsonpath={.status.state}")
		if im != "running" {
			return false, fmt.Errorf("instance manager on %s is %q", node, im)
		}
		csi, _ := c.kubectl(ctx, "", "-n", cairnNS, "get", "pod", "-l", "app.kubernetes.io/component=csi-node", "--field-selector", "spec.nodeName="+node,
			"-o", `jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}`)
		return csi == "True", fmt.Errorf("CSI node plugin on %s Ready=%q", node, csi)
	})
}

// cutNetwork drops every packet on the node's link to the other nodes
// (eth0 of the kind node: its own traffic and its pods'), in a chain of
// the harness's own, and registers the healer that removes it.
func (r *runner) cutNetwork(ctx context.Context, node string) error {
	r.heals.add("cut "+node, func(ctx context.Context) error { return r.mendNetwork(ctx, node) })
	script := fmt.Sprintf(`set -e
iptables -w -N %[1]s
iptables -w -A %[1]s -i eth0 -j DROP
iptables -w -A %[1]s -o eth0 -j DROP
for c in INPUT OUTPUT FORWARD; do iptables -w -I $c 1 -j %[1]s; done`, chaosChain)
	_, err := r.c.nodeExec(ctx, node, script)
	return err
}

// mendNetwork removes the harness's chain from the node, wherever it is
// referenced; a node without it is left as it is.
func (r *runner) mendNetwork(ctx context.Context, node string) error {
	script := fmt.Sprintf(`iptables -w -S %[1]s >/dev/null 2>&1 || exit 0
for c in INPUT OUTPUT FORWARD; do while iptables -w -D $c -j %[1]s 2>/dev/null; do :; done; done
iptables -w -F %[1]s && iptables -w -X %[1]s`, chaosChain)
	_, err := r.c.nodeExec(ctx, node, script)
	return err
}

// fillDisk writes a ballast into the node's replica data directory: a
// tenth of the free space, at most 2 GiB (the kind nodes' data
// directories are on the host's disk, which the run must not fill), and
// registers the healer that removes it.
func (r *runner) fillDisk(ctx context.Context, node string) error {
	r.heals.add("fill "+node, func(ctx context.Context) error {
		_, err := r.c.nodeExec(ctx, node, "rm -f "+ballast)
		return err
	})
	script := fmt.Sprintf(`avail=$(df -k --output=avail %s | tail -1); kb=$((avail/10)); [ $kb -gt 2097152 ] && kb=2097152
fallocate -l ${kb}KiB %s || dd if=/dev/zero of=%s bs=1M count=$((kb/1024)) status=none
echo $kb`, dataDir, ballast, ballast)
	out, err := r.c.nodeExec(ctx, node, script)
	if err == nil {
		r.c.logf("    ballast of %s KiB in %s on %s", strings.TrimSpace(out), dataDir, node)
	}
	return err
}

// rolloutRestart rolls a DaemonSet of Cairn and waits until every pod is
// new and ready (the instance manager's readiness gate holds each node
// until its volumes are served again).
func (r *runner) rolloutRestart(ctx context.Context, ds string) error {
	c := r.c
	if _, err := c.kubectl(ctx, "", "-n", cairnNS, "rollout", "restart", "daemonset/"+ds); err != nil {
		return err
	}
	return poll(ctx, rolloutBound, 5*time.Second, func() (bool, error) {
		_, err := c.kubectl(ctx, "", "-n", cairnNS, "rollout", "status", "daemonset/"+ds, "--timeout=30s")
		return err == nil, err
	})
}

// leftovers lists what a fault of an earlier run left on the nodes (a
// cut, a ballast), removing it: a run starts from a clean cluster.
func (r *runner) leftovers(ctx context.Context) []string {
	var found []string
	for _, n := range r.c.nodes {
		if _, err := r.c.nodeExec(ctx, n, "iptables -w -S "+chaosChain+" >/dev/null 2>&1"); err == nil {
			found = append(found, "iptables chain "+chaosChain+" on "+n)
			if err := r.mendNetwork(ctx, n); err != nil {
				found = append(found, fmt.Sprintf("(removing it failed: %v)", err))
			}
		}
		if _, err := r.c.nodeExec(ctx, n, "test -e "+ballast); err == nil {
			found = append(found, ballast+" on "+n)
			if _, err := r.c.nodeExec(ctx, n, "rm -f "+ballast); err != nil {
				found = append(found, fmt.Sprintf("(removing it failed: %v)", err))
			}
		}
	}
	return found
}
