package volume

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/replica"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestManagerRestartConverges stops the manager at points inside attach,
// detach, a rebuild and delete (as soon as the point is observed, while
// reconciles are under way), starts a new one, and checks that it
// converges: exactly one engine process and one process per replica
// while attached, none while detached, nothing (process or directory)
// left after delete, and the data intact. The new manager knows only
// what the API server and the instance managers tell it. In-process the
// manager is stopped (its context cancelled); as a cairn-manager process
// it is killed with SIGKILL, whatever it was doing.
func TestManagerRestartConverges(t *testing.T) {
	t.Run("in-process", func(t *testing.T) {
		testRestarts(t, "mr", testEnv.StopManager, func() error { return testEnv.StartManager() })
	})
	t.Run("SIGKILL", func(t *testing.T) {
		testEnv.StopManager()
		defer func() {
			if err := testEnv.StartManager(); err != nil {
				t.Errorf("start the in-process manager again: %v", err)
			}
		}()
		bin := managerBinary(t)
		kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
		kc, err := testEnv.KubeConfig()
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
			t.Fatal(err)
		}
		var cmd *exec.Cmd
		start := func() error {
			cmd = exec.Command(bin, "--kubeconfig", kubeconfig, "--discover-instance-managers=false", "--namespace", "default",
				// The test's instance managers serve loopback without TLS.
				"--instance-manager-tls=false",
				"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--replenishment-wait", replenishmentWait.String())
			cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
			return cmd.Start()
		}
		kill := func() {
			cmd.Process.Signal(syscall.SIGKILL)
			_ = cmd.Wait() // killed: it exits with the signal
		}
		if err := start(); err != nil {
			t.Fatal(err)
		}
		defer func() { kill() }()
		testRestarts(t, "mk", kill, start)
	})
}

// managerBinary builds cmd/manager once.
func managerBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "cairn-manager")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/cairn-io/cairn/cmd/manager").CombinedOutput()
	if err != nil {
		t.Fatalf("build cairn-manager: %v\n%s", err, out)
	}
	return bin
}

// testRestarts drives a volume through attach, detach, attach elsewhere,
// a rebuild and delete, stopping the manager (stop) at a point inside
// each and starting another (start).
func testRestarts(t *testing.T, prefix string, stop func(), start func() error) {
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{prefix + "-a", prefix + "-b", prefix + "-c"}
	_, ims := startNodes(t, g, names...)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: prefix + "-restart", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	key := client.ObjectKeyFromObject(vol)
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())

	get := func() *v1.Volume {
		out := &v1.Volume{}
		if err := k8sClient.Get(ctx, key, out); err != nil {
			return &v1.Volume{}
		}
		return out
	}
	engine := func() *v1.Engine {
		e := &v1.Engine{}
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: vol.Name + "-e"}, e); err != nil {
			return nil
		}
		return e
	}
	replicas := func() []v1.Replica { return listReplicas(g, vol) }
	// processes counts this volume's engine and replica processes on
	// every node, as the instance managers list them.
	processes := func() (engines, reps int) {
		for _, im := range ims {
			cc, err := grpc.NewClient(im.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			g.Expect(err).NotTo(HaveOccurred())
			cctx, cancel := context.WithTimeout(ctx, deadline.Scale(10*time.Second))
			res, err := imv1.NewInstanceManagerServiceClient(cc).ProcessList(cctx, &imv1.ProcessListRequest{})
			cancel()
			cc.Close()
			g.Expect(err).NotTo(HaveOccurred())
			for _, p := range res.GetProcesses() {
				switch {
				case p.GetName() == "default/"+vol.Name+"-e":
					engines++
				case strings.HasPrefix(p.GetName(), "default/"+vol.Name+"-r-"):
					reps++
				}
			}
		}
		return engines, reps
	}
	// restartWhen stops the manager as soon as cond holds and starts a
	// new one.
	restartWhen := func(what string, cond func() bool) {
		t.Helper()
		g.Eventually(cond, timeout, 5*time.Millisecond).Should(BeTrue(), func() string { return what + describe(ctx, get()) })
		stop()
		t.Logf("manager stopped at: %s", what)
		g.Expect(start()).To(Succeed())
	}
	state := func(want v1.VolumeState) func() bool { return func() bool { return get().Status.State == want } }
	healthy := func() bool {
		v := get()
		return v.Status.State == v1.VolumeStateAttached && v.Status.Robustness == v1.VolumeRobustnessHealthy
	}
	checkAttached := func() {
		t.Helper()
		g.Eventually(healthy, timeout, 100*time.Millisecond).Should(BeTrue(), func() string { return describe(ctx, get()) })
		g.Eventually(func() []int { e, r := processes(); return []int{e, r} }, timeout, 100*time.Millisecond).Should(Equal([]int{1, 3}),
			"one engine and three replica processes")
		g.Consistently(func() []int { e, r := processes(); return []int{e, r} }, time.Second, 200*time.Millisecond).Should(Equal([]int{1, 3}))
		g.Expect(replicas()).To(HaveLen(3))
	}
	checkDetached := func() {
		t.Helper()
		g.Eventually(state(v1.VolumeStateDetached), timeout, 100*time.Millisecond).Should(BeTrue())
		g.Eventually(func() []int { e, r := processes(); return []int{e, r} }, timeout, 100*time.Millisecond).Should(Equal([]int{0, 0}))
	}

	g.Eventually(state(v1.VolumeStateDetached), timeout, 100*time.Millisecond).Should(BeTrue())

	// Attach, stopped while replicas start (engine not asked for yet).
	setNode(g, key, names[0])
	restartWhen("attach: a replica asked to run, the engine not yet", func() bool {
		e := engine()
		for _, r := range replicas() {
			if r.Spec.DesiredState == v1.DesiredInstanceStateRunning && e != nil && e.Spec.DesiredState != v1.DesiredInstanceStateRunning {
				return true
			}
		}
		return false
	})
	checkAttached()
	qemuIO(t, vol.Name, get().Status.Endpoint, "write -P 0x5a 0 2M", "flush")

	// Detach, stopped once the engine is asked to stop.
	setNode(g, key, "")
	restartWhen("detach: the engine asked to stop", func() bool {
		e := engine()
		return e != nil && e.Spec.DesiredState == v1.DesiredInstanceStateStopped
	})
	checkDetached()

	// Attach elsewhere, stopped once the engine is asked to run but before
	// it reports running.
	setNode(g, key, names[1])
	restartWhen("attach: the engine asked to run, not running yet", func() bool {
		e := engine()
		return e != nil && e.Spec.DesiredState == v1.DesiredInstanceStateRunning && e.Status.InstanceState != v1.InstanceStateRunning
	})
	checkAttached()

	// A rebuild: a replica process killed; stopped once it is marked failed.
	victim := replicas()[1]
	g.Expect(syscall.Kill(replicaPID(t, replica.DataDir(&victim)), syscall.SIGKILL)).To(Succeed())
	restartWhen("rebuild: the killed replica marked failed", func() bool {
		for _, r := range replicas() {
			if r.Name == victim.Name && r.Spec.FailedAt != nil {
				return true
			}
		}
		return false
	})
	checkAttached()
	qemuIO(t, vol.Name, get().Status.Endpoint, "read -P 0x5a 0 2M")

	// Delete, stopped once the engine is gone and replicas remain.
	reps := replicas()
	g.Expect(k8sClient.Delete(ctx, get())).To(Succeed())
	restartWhen("delete: the volume is deleting", func() bool { return !get().DeletionTimestamp.IsZero() })
	g.Eventually(func() bool { return apierrors.IsNotFound(k8sClient.Get(ctx, key, &v1.Volume{})) }, timeout, 100*time.Millisecond).Should(BeTrue())
	g.Eventually(func() []int { e, r := processes(); return []int{e, r} }, timeout, 100*time.Millisecond).Should(Equal([]int{0, 0}))
	for _, r := range reps {
		_, err := os.Stat(replica.DataDir(&r))
		g.Expect(os.IsNotExist(err)).To(BeTrue(), "replica %s data left behind: %v", r.Name, err)
	}
	g.Expect(engine()).To(BeNil())
	g.Expect(replicas()).To(BeEmpty())
}

// TestConcurrentVolumes: 20 volumes created, attached, detached and
// deleted at once on four nodes all converge, and nothing is left: no
// process, no replica directory, no object.
func TestConcurrentVolumes(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"cc-a", "cc-b", "cc-c", "cc-d"}
	dirs := nodes(t, g, names...)
	const n = 20
	var vols []*v1.Volume
	for i := range n {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "many-" + string(rune('a'+i)), Namespace: "default"}, Spec: v1.VolumeSpec{
			Size: resource.MustParse("4Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD}}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
		vols = append(vols, v)
	}
	all := func(pred func(*v1.Volume) bool) func() int {
		return func() int {
			ok := 0
			for _, v := range vols {
				cur := &v1.Volume{}
				if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(v), cur); err == nil && pred(cur) {
					ok++
				}
			}
			return ok
		}
	}
	g.Eventually(all(func(v *v1.Volume) bool { return v.Status.State == v1.VolumeStateDetached }), 2*timeout, 200*time.Millisecond).Should(Equal(n))
	for i, v := range vols {
		setNode(g, client.ObjectKeyFromObject(v), names[i%len(names)])
	}
	attached := func(v *v1.Volume) bool {
		return v.Status.State == v1.VolumeStateAttached && v.Status.Robustness == v1.VolumeRobustnessHealthy
	}
	if !poll(func() bool { return all(attached)() == n }) {
		for _, v := range vols {
			cur := &v1.Volume{}
			if k8sClient.Get(ctx, client.ObjectKeyFromObject(v), cur) == nil && !attached(cur) {
				t.Errorf("volume %s not attached and healthy: %s", v.Name, describe(ctx, cur))
				for node, dir := range dirs {
					if log, err := os.ReadFile(filepath.Join(dir, ".logs", "default_"+EngineName(v)+".log")); err == nil {
						t.Logf("engine log on %s:\n%s", node, log)
					}
				}
			}
		}
		t.FailNow()
	}
	for _, v := range vols {
		setNode(g, client.ObjectKeyFromObject(v), "")
	}
	g.Eventually(all(func(v *v1.Volume) bool { return v.Status.State == v1.VolumeStateDetached }), 3*timeout, 200*time.Millisecond).Should(Equal(n))
	for _, v := range vols {
		g.Expect(k8sClient.Delete(ctx, v)).To(Succeed())
	}
	g.Eventually(all(func(*v1.Volume) bool { return true }), 3*timeout, 200*time.Millisecond).Should(BeZero())
	var reps v1.ReplicaList
	g.Expect(k8sClient.List(ctx, &reps, client.InNamespace("default"))).To(Succeed())
	for _, r := range reps.Items {
		g.Expect(r.Spec.VolumeName).NotTo(HavePrefix("many-"), "replica object left: %s", r.Name)
	}
	for node, dir := range dirs {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			g.Expect(e.Name()).NotTo(HavePrefix("many-"), "replica data left on %s", node)
		}
	}
	for _, n := range names {
		var im v1.InstanceManager
		g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: "im-" + n}, &im)).To(Succeed())
		for _, p := range im.Status.Processes {
			g.Expect(p.Name).NotTo(ContainSubstring("/many-"), "process left on %s", n)
		}
	}
}

// describe is what a failed test shows of a volume: its status, its
// engine's and its replicas'.
func describe(ctx context.Context, v *v1.Volume) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\nvolume: %+v", v.Status)
	e := &v1.Engine{}
	if k8sClient.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: EngineName(v)}, e) == nil {
		fmt.Fprintf(&b, "\nengine spec: %+v\nengine status: %+v", e.Spec, e.Status)
		im := &v1.InstanceManager{}
		if k8sClient.Get(ctx, client.ObjectKey{Namespace: v.Namespace, Name: e.Status.InstanceManagerName}, im) == nil {
			for _, p := range im.Status.Processes {
				if strings.Contains(p.Name, EngineName(v)) {
					fmt.Fprintf(&b, "\nengine process as %s reports it: %+v (instance manager %s, %v)", im.Name, p, im.Status.State, im.Status.Conditions)
					if cc, err := grpc.NewClient(im.Spec.Address, grpc.WithTransportCredentials(insecure.NewCredentials())); err == nil {
						if pr, err := imv1.NewInstanceManagerServiceClient(cc).ProcessGet(ctx, &imv1.ProcessGetRequest{Name: p.Name}); err == nil {
							fmt.Fprintf(&b, "\n  log tail: %q\n  process: %v", pr.GetLogTail(), pr)
						}
						cc.Close()
					}
				}
			}
		}
	}
	var reps v1.ReplicaList
	if k8sClient.List(ctx, &reps, client.InNamespace(v.Namespace), client.MatchingLabels{LabelVolume: v.Name}) == nil {
		for _, r := range reps.Items {
			fmt.Fprintf(&b, "\nreplica %s spec: %+v\n  status: %+v", r.Name, r.Spec, r.Status)
		}
	}
	return b.String()
}

// poll reports whether cond held within the suite's timeout.
func poll(cond func() bool) bool {
	for end := time.Now().Add(timeout); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}
