//go:build chaoscluster

package chaoscluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"sort"
	"strings"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// cairnNS is the namespace Cairn is deployed in.
const cairnNS = "cairn-system"

// commandTimeout bounds one kubectl or docker call, so that a call to a
// node whose network is cut cannot hang a schedule.
const commandTimeout = 2 * time.Minute

// cluster runs kubectl against one context and docker against its nodes.
type cluster struct {
	context string
	log     io.Writer
	// nodes are the cluster's node names, sorted; controlPlane is the one
	// that holds the API server (never stopped or cut off).
	nodes        []string
	controlPlane string
}

// run runs a command with stdin and returns its trimmed stdout, within
// commandTimeout.
func run(ctx context.Context, stdin string, name string, args ...string) (string, error) {
	return runFor(ctx, commandTimeout, stdin, name, args...)
}

// runFor is run within timeout (scaled), for commands that wait
// themselves (kubectl wait, delete --wait).
func runFor(ctx context.Context, timeout time.Duration, stdin string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, deadline.Scale(timeout))
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	if err := cmd.Run(); err != nil {
		return strings.TrimSpace(out.String()), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

// kubectl runs kubectl in the cluster's context.
func (c *cluster) kubectl(ctx context.Context, stdin string, args ...string) (string, error) {
	return run(ctx, stdin, "kubectl", append([]string{"--context", c.context}, args...)...)
}

// kubectlFor runs kubectl within timeout.
func (c *cluster) kubectlFor(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return runFor(ctx, timeout, "", "kubectl", append([]string{"--context", c.context}, args...)...)
}

// getJSON decodes `kubectl get ... -o json` into v.
func (c *cluster) getJSON(ctx context.Context, v any, args ...string) error {
	out, err := c.kubectl(ctx, "", append(append([]string{"get"}, args...), "-o", "json")...)
	if err != nil {
		return err
	}
	return json.Unmarshal([]byte(out), v)
}

// nodeExec runs a shell script inside a kind node's container.
func (c *cluster) nodeExec(ctx context.Context, node, script string) (string, error) {
	return run(ctx, "", "docker", "exec", node, "sh", "-c", script)
}

// logf writes a line of the run's log.
func (c *cluster) logf(format string, args ...any) {
	fmt.Fprintf(c.log, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

// discover reads the nodes and checks that the cluster is as the run
// needs it: every node Ready, Cairn's components running.
func (c *cluster) discover(ctx context.Context) error {
	var nodes struct {
		Items []struct {
			Metadata struct {
				Name   string            `json:"name"`
				Labels map[string]string `json:"labels"`
			} `json:"metadata"`
		} `json:"items"`
	}
	if err := c.getJSON(ctx, &nodes, "nodes"); err != nil {
		return err
	}
	c.nodes = nil
	for _, n := range nodes.Items {
		c.nodes = append(c.nodes, n.Metadata.Name)
		if _, ok := n.Metadata.Labels["node-role.kubernetes.io/control-plane"]; ok {
			c.controlPlane = n.Metadata.Name
		}
	}
	sort.Strings(c.nodes)
	if len(c.nodes) < 3 || c.controlPlane == "" {
		return fmt.Errorf("the run needs three nodes, one of them the control plane; found %v (control plane %q)", c.nodes, c.controlPlane)
	}
	return c.healthyCluster(ctx)
}

// workers are the nodes other than the control plane, sorted.
func (c *cluster) workers() []string {
	var out []string
	for _, n := range c.nodes {
		if n != c.controlPlane {
			out = append(out, n)
		}
	}
	return out
}

// errUnhealthy marks a cluster that is not in the state a schedule starts
// from (a node not Ready, a component not running).
var errUnhealthy = errors.New("cluster not healthy")

// healthyCluster checks every node Ready and every Cairn workload rolled
// out and available.
func (c *cluster) healthyCluster(ctx context.Context) error {
	for _, n := range c.nodes {
		if r := c.nodeReady(ctx, n); r != "True" {
			return fmt.Errorf("%w: node %s Ready=%q", errUnhealthy, n, r)
		}
	}
	for _, w := range []string{"daemonset/cairn-instance-manager", "daemonset/cairn-csi-node", "deployment/cairn-manager", "deployment/cairn-csi-controller"} {
		if _, err := c.kubectl(ctx, "", "-n", cairnNS, "rollout", "status", w, "--timeout=5s"); err != nil {
			return fmt.Errorf("%w: %s not rolled out: %w", errUnhealthy, w, err)
		}
	}
	return nil
}

func (c *cluster) nodeReady(ctx context.Context, node string) string {
	out, _ := c.kubectl(ctx, "", "get", "node", node, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
	return out
}

// podOn is the name of the Cairn pod of component on node ("" if none).
func (c *cluster) podOn(ctx context.Context, component, node string) (string, error) {
	out, err := c.kubectl(ctx, "", "-n", cairnNS, "get", "pod", "-l", "app.kubernetes.io/component="+component,
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		return "", err
	}
	if f := strings.Fields(out); len(f) > 0 {
		return f[0], nil
	}
	return "", nil
}

// poll calls cond every interval until it returns true, an error that
// is final, or the (scaled) timeout passes; its last complaint is the
// error then.
func poll(ctx context.Context, timeout, interval time.Duration, cond func() (bool, error)) error {
	end := deadline.After(timeout)
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if err != nil {
			last = err
		}
		if time.Now().After(end) {
			if last == nil {
				last = errors.New("condition not met")
			}
			return fmt.Errorf("after %s: %w", deadline.Scale(timeout), last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
}

// sleep waits d or until ctx ends: the nemesis's gaps and holds, which are
// the fault's timing, not a wait for an event.
func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
