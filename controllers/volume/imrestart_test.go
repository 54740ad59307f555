package volume

import (
	"context"
	"net"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestEngineNodeInstanceManagerNewAddress: the instance manager of the
// engine's node goes (its pod deleted: the engine and the node's replica
// die with it) and a new one comes up at another address (a new pod IP:
// here 127.0.0.2, same data directory), which the InstanceManager gets as
// PodDiscovery gives it: cleared while no pod is ready, then the new pod's.
// The replica's old addresses now belong to something that accepts and
// never answers (an IP handed to another pod). The volume is attached and
// healthy again within the suite's deadline with every byte written
// before, and no engine process is ever given the replica's old address:
// the restarted engine follows the replicas' current addresses. The
// engine is started there once, with the three replicas: the manager
// waits for the node's replica, which the engine's open needs (it was RW
// at the newest epoch), while its process starts, instead of starting an
// engine without it and starting it again when the replica runs.
func TestEngineNodeInstanceManagerNewAddress(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	names := []string{"na-a", "na-b", "na-c"}
	dirs, ims := startNodes(t, g, names...)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "new-address", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 3, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	healthy := func() bool {
		v := getVolume(g, key)
		return v.Status.State == v1.VolumeStateAttached && v.Status.Robustness == v1.VolumeRobustnessHealthy && rwReplicas(g, vol) == 3
	}
	setNode(g, key, "na-a")
	g.Eventually(healthy, timeout, 100*time.Millisecond).Should(BeTrue(), func() string { return describeKey(key) })
	qemuIO(t, vol.Name, getVolume(g, key).Status.Endpoint, "write -P 0x5a 0 4M", "flush")
	var local v1.Replica
	for _, r := range listReplicas(g, vol) {
		if r.Spec.NodeName == "na-a" {
			local = r
		}
	}
	g.Expect(local.Name).NotTo(BeEmpty(), "a replica on the engine's node")
	old := v1.ReplicaAddress{Data: local.Status.LocalAddress, Control: local.Status.ControlAddress}
	g.Expect(old.Data).To(HavePrefix("unix:"), "the replica on the engine's node serves a unix socket too")
	g.Expect(getEngine(g, vol).Spec.ReplicaAddresses).To(HaveKeyWithValue(local.Name, old), "the engine reaches its node's replica through the socket")
	for _, r := range listReplicas(g, vol) {
		if r.Name != local.Name {
			g.Expect(getEngine(g, vol).Spec.ReplicaAddresses[r.Name].Data).To(Equal(r.Status.Address), "replicas on other nodes are reached over TCP")
		}
	}

	// The pod goes: its processes die with it, and no ready pod means no
	// address.
	ims["na-a"].Kill()
	setIMAddress(g, "im-na-a", "")
	holes := blackholes(t, local.Status.Address, old.Control) // its TCP ports; the socket's path is the new process's too
	ims["na-a"] = imtest.Start(t, "na-a", freeAddrOn(t, "127.0.0.2"), dirs["na-a"])
	// Every engine process the new instance manager starts is recorded
	// from its process watch, before the manager is told of it.
	starts := engineStarts(t, ims["na-a"].Addr, "default/"+EngineName(vol))
	start := time.Now()
	setIMAddress(g, "im-na-a", ims["na-a"].Addr)

	g.Eventually(healthy, timeout, 100*time.Millisecond).Should(BeTrue(), func() string { return describeKey(key) })
	t.Logf("attached and healthy again %s after the new instance manager was named", time.Since(start).Round(100*time.Millisecond))
	g.Expect(holes.Load()).To(BeZero(), "nothing connected to the replica's old address")
	now := getEngine(g, vol).Spec.ReplicaAddresses[local.Name]
	g.Expect(now).NotTo(Equal(old), "the engine's spec follows the replica's new address")
	g.Expect(now.Data).To(HavePrefix("unix:"), "the engine reaches its node's new replica process through its socket")
	host, _, err := net.SplitHostPort(now.Control)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(host).To(Equal("127.0.0.2"), "the replica runs under the new instance manager")
	// The engine is started once, with every replica at its current
	// address: the node's replica, RW with the last engine, is held for
	// while its process starts (an engine without it could not open, and
	// would be started again once it runs), and no engine process is
	// ever given its old address.
	given := starts()
	g.Expect(given).To(HaveLen(1), "engine processes started on the new instance manager (replicas given to each): %v", given)
	var want []string
	for _, a := range getEngine(g, vol).Spec.ReplicaAddresses {
		want = append(want, a.Data+","+a.Control)
	}
	g.Expect(want).To(HaveLen(3))
	g.Expect(given[0]).To(ConsistOf(want), "the engine was started with the three replicas at their current addresses")
	g.Expect(given[0]).NotTo(ContainElement(old.Data+","+old.Control), "an engine process was given the replica's old address")

	sock := getVolume(g, key).Status.Endpoint
	qemuIO(t, vol.Name, sock, "read -P 0x5a 0 4M", "write -P 0x6b 4M 1M", "flush", "read -P 0x6b 4M 1M")

	// Deleted here, while the new instance manager runs (its cleanup
	// comes before cleanupVolume's).
	g.Expect(k8sClient.Delete(ctx, getVolume(g, key))).To(Succeed())
	g.Eventually(func() bool { return apierrors.IsNotFound(k8sClient.Get(ctx, key, &v1.Volume{})) }, timeout, 100*time.Millisecond).Should(BeTrue())
}

// setIMAddress sets an InstanceManager's spec.address, as PodDiscovery
// does when the node's pod changes.
func setIMAddress(g *WithT, name, addr string) {
	im := &v1.InstanceManager{}
	g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, im)).To(Succeed())
	before := im.DeepCopy()
	im.Spec.Address = addr
	g.Expect(k8sClient.Patch(context.Background(), im, client.MergeFrom(before))).To(Succeed())
}

// freeAddrOn returns a free address on the loopback IP ip.
func freeAddrOn(t *testing.T, ip string) string {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// blackholes listens on addrs (once the processes that had them are gone)
// until the test ends, accepting connections and never answering, and
// counts the connections.
func blackholes(t *testing.T, addrs ...string) *atomic.Int32 {
	t.Helper()
	var n atomic.Int32
	var mu sync.Mutex
	var held []net.Conn
	for _, a := range addrs {
		var l net.Listener
		if !poll(func() bool {
			var err error
			l, err = net.Listen("tcp", a)
			return err == nil
		}) {
			t.Fatalf("%s stays taken after its instance manager was killed", a)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				n.Add(1)
				mu.Lock()
				held = append(held, c)
				mu.Unlock()
			}
		}()
	}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	return &n
}

// engineStarts follows the process watch of the instance manager at addr
// until the test ends (from its first snapshot, which it waits for) and
// returns a function that lists, per engine
// process named name that it saw start (by pid), the replicas it was
// given ("data,control", in the order given).
func engineStarts(t *testing.T, addr, name string) func() [][]string {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); cc.Close() })
	var mu sync.Mutex
	byPid := map[int32][]string{}
	var order []int32
	note := func(p *imv1.Process) {
		eng := p.GetEngine()
		if p.GetName() != name || eng == nil || p.GetPid() == 0 {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if _, ok := byPid[p.GetPid()]; ok {
			return
		}
		var addrs []string
		for _, r := range eng.GetReplicas() {
			addrs = append(addrs, r.GetData()+","+r.GetControl())
		}
		byPid[p.GetPid()] = addrs
		order = append(order, p.GetPid())
	}
	watching := make(chan error, 1)
	go func() {
		st, err := imv1.NewInstanceManagerServiceClient(cc).ProcessWatch(ctx, &imv1.ProcessWatchRequest{}, grpc.WaitForReady(true))
		if err != nil {
			watching <- err
			return
		}
		for first := true; ; first = false {
			ev, err := st.Recv()
			if first {
				watching <- err // the snapshot: nothing started before it is missed
			}
			if err != nil {
				return
			}
			for _, p := range ev.GetProcesses() {
				note(p)
			}
			if p := ev.GetProcess(); p != nil {
				note(p)
			}
		}
	}()
	select {
	case err := <-watching:
		if err != nil {
			t.Fatalf("process watch of %s: %v", addr, err)
		}
	case <-time.After(deadline.Scale(30 * time.Second)):
		t.Fatalf("process watch of %s: not started", addr)
	}
	return func() [][]string {
		mu.Lock()
		defer mu.Unlock()
		out := make([][]string, 0, len(order))
		for _, pid := range order {
			out = append(out, byPid[pid])
		}
		return out
	}
}
