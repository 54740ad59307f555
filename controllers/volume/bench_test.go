package volume

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestBenchControl prints the control plane's figures (make
// bench-control): create -> attached latency of one volume and of 20 at
// once, as ratios to the same processes started straight through the
// instance managers in the same run (the data plane's own start time);
// the manager's reconciles per second meanwhile; and the heap with 1,000
// detached volumes. Figures, not assertions on time: the machines are
// shared and noisy.
func TestBenchControl(t *testing.T) {
	if os.Getenv("CAIRN_BENCH_CONTROL") == "" {
		t.Skip("a benchmark: run it with make bench-control")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"bn-a", "bn-b", "bn-c", "bn-d"}
	dirs := nodes(t, g, names...)

	// Baseline: three replicas and an engine created straight through the
	// instance managers, until the engine reports running.
	raw := func(i int) time.Duration {
		clients := map[string]imv1.InstanceManagerServiceClient{}
		for _, n := range names[:3] {
			var im v1.InstanceManager
			g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: "default", Name: "im-" + n}, &im)).To(Succeed())
			cc, err := grpc.NewClient(im.Spec.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
			g.Expect(err).NotTo(HaveOccurred())
			defer cc.Close()
			clients[n] = imv1.NewInstanceManagerServiceClient(cc)
		}
		start := time.Now()
		var addrs []*imv1.ReplicaAddress
		for _, n := range names[:3] {
			name := fmt.Sprintf("raw/r-%d-%s", i, n)
			_, err := clients[n].ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Replica{
				Replica: &imv1.ReplicaSpec{DataDir: dirs[n] + fmt.Sprintf("/raw-%d", i), SizeBytes: 16 << 20}}})
			g.Expect(err).NotTo(HaveOccurred())
			defer func() { _, _ = clients[n].ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: name}) }()
		}
		for _, n := range names[:3] {
			name := fmt.Sprintf("raw/r-%d-%s", i, n)
			var p *imv1.Process
			g.Eventually(func() imv1.ProcessState {
				var err error
				p, err = clients[n].ProcessGet(ctx, &imv1.ProcessGetRequest{Name: name})
				g.Expect(err).NotTo(HaveOccurred())
				return p.GetState()
			}, timeout, 2*time.Millisecond).Should(Equal(imv1.ProcessState_PROCESS_STATE_RUNNING))
			addrs = append(addrs, &imv1.ReplicaAddress{Data: p.GetDataAddress(), Control: p.GetControlAddress()})
		}
		name := fmt.Sprintf("raw/e-%d", i)
		_, err := clients[names[0]].ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Engine{
			Engine: &imv1.EngineSpec{VolumeName: fmt.Sprintf("raw-%d", i), Replicas: addrs, Frontend: imv1.Frontend_FRONTEND_NBD}}})
		g.Expect(err).NotTo(HaveOccurred())
		defer func() { _, _ = clients[names[0]].ProcessDelete(ctx, &imv1.ProcessDeleteRequest{Name: name}) }()
		g.Eventually(func() imv1.ProcessState {
			p, err := clients[names[0]].ProcessGet(ctx, &imv1.ProcessGetRequest{Name: name})
			g.Expect(err).NotTo(HaveOccurred())
			return p.GetState()
		}, timeout, 2*time.Millisecond).Should(Equal(imv1.ProcessState_PROCESS_STATE_RUNNING))
		return time.Since(start)
	}

	// attachAll creates volumes already asking for a node and returns each
	// one's create -> attached time.
	seq := 0
	attachAll := func(n int) []time.Duration {
		var vols []*v1.Volume
		starts := map[string]time.Time{}
		for i := range n {
			seq++
			v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("bench-%d", seq), Namespace: "default"}, Spec: v1.VolumeSpec{
				Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD, NodeName: names[i%len(names)]}}
			starts[v.Name] = time.Now()
			g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
			vols = append(vols, v)
		}
		done := map[string]time.Duration{}
		g.Eventually(func() int {
			for _, v := range vols {
				if _, ok := done[v.Name]; ok {
					continue
				}
				cur := &v1.Volume{}
				if k8sClient.Get(ctx, client.ObjectKeyFromObject(v), cur) == nil && cur.Status.State == v1.VolumeStateAttached {
					done[v.Name] = time.Since(starts[v.Name])
				}
			}
			return len(done)
		}, 3*timeout, 5*time.Millisecond).Should(Equal(n))
		for _, v := range vols {
			g.Expect(k8sClient.Delete(ctx, v)).To(Succeed())
		}
		g.Eventually(func() int {
			var l v1.VolumeList
			g.Expect(k8sClient.List(ctx, &l, client.InNamespace("default"))).To(Succeed())
			return len(l.Items)
		}, 3*timeout, 50*time.Millisecond).Should(BeZero())
		var out []time.Duration
		for _, d := range done {
			out = append(out, d)
		}
		slices.Sort(out)
		return out
	}
	pct := func(ds []time.Duration, p int) time.Duration { return ds[(len(ds)-1)*p/100] }

	var rawTimes, one []time.Duration
	for i := range 5 {
		rawTimes = append(rawTimes, raw(i))
		one = append(one, attachAll(1)...)
	}
	slices.Sort(rawTimes)
	slices.Sort(one)
	base := pct(rawTimes, 50)
	r0 := reconciles(t)
	t0 := time.Now()
	twenty := attachAll(20)
	rps := float64(reconciles(t)-r0) / time.Since(t0).Seconds()

	// 1,000 detached volumes: the heap of this process (the manager, its
	// caches and the test's client) once they have settled.
	const many = 1000
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range many {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("idle-%d", i), Namespace: "default"}, Spec: v1.VolumeSpec{
			Size: resource.MustParse("1Mi"), NumberOfReplicas: 3}}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
	}
	g.Eventually(func() int {
		var l v1.VolumeList
		g.Expect(k8sClient.List(ctx, &l, client.InNamespace("default"))).To(Succeed())
		n := 0
		for _, v := range l.Items {
			if v.Status.State == v1.VolumeStateDetached {
				n++
			}
		}
		return n
	}, deadline.Scale(10*time.Minute), time.Second).Should(Equal(many))
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)

	fmt.Printf("\ncontrol plane, %d cores (envtest API server, 4 instance managers on loopback)\n", runtime.NumCPU())
	fmt.Printf("%-44s %10s %10s %8s\n", "", "p50", "p99", "x raw")
	fmt.Printf("%-44s %10v %10v %8.2f\n", "raw: 3 replicas + engine via instance managers", base.Round(time.Millisecond), pct(rawTimes, 99).Round(time.Millisecond), 1.0)
	fmt.Printf("%-44s %10v %10v %8.2f\n", "1 volume: create -> attached", pct(one, 50).Round(time.Millisecond), pct(one, 99).Round(time.Millisecond), float64(pct(one, 50))/float64(base))
	fmt.Printf("%-44s %10v %10v %8.2f\n", "20 volumes at once: create -> attached", pct(twenty, 50).Round(time.Millisecond), pct(twenty, 99).Round(time.Millisecond), float64(pct(twenty, 50))/float64(base))
	fmt.Printf("reconciles per second (20 volumes): %.0f\n", rps)
	fmt.Printf("heap with %d detached volumes (%d objects): %.1f MiB in use, %.1f MiB more than before them\n",
		many, many*5, float64(after.HeapInuse)/(1<<20), (float64(after.HeapInuse)-float64(before.HeapInuse))/(1<<20))
	fmt.Printf("goal: 1 volume attached in under 3 s; manager under 100 MiB at 1,000 volumes\n")
}

// reconciles is the manager's reconcile count so far (all controllers).
func reconciles(t *testing.T) float64 {
	mfs, err := crmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() == "controller_runtime_reconcile_total" {
			for _, m := range mf.GetMetric() {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}
