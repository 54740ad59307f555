package snapshot

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/engineserver"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

const size = 16 << 20

var timeout = deadline.Scale(60 * time.Second)

// startEngine runs an engine over two replicas in process, its control
// API on loopback, as `cairn-data engine` serves it; it returns the
// engine and its control address.
func startEngine(t *testing.T) (*engine.Engine, string) {
	t.Helper()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	var addrs []string
	for i := range 2 {
		r, err := replica.Open(filepath.Join(t.TempDir(), fmt.Sprint("r", i)), replica.Options{Size: size})
		if err != nil {
			t.Fatal(err)
		}
		dl, cl := listen(), listen()
		run := replicaserver.Start(r, replicaserver.Options{Data: dl, Control: cl})
		t.Cleanup(run.Kill)
		addrs = append(addrs, dl.Addr().String()+","+cl.Addr().String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	e, err := engine.Open(ctx, engine.Options{Name: "vol", Replicas: addrs,
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{Conns: 1}})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	gs := grpc.NewServer()
	enginev1.RegisterEngineServiceServer(gs, &engineserver.Server{E: e, Name: "vol"})
	l := listen()
	// Serve returns nil once Stop runs at cleanup; a failure before then
	// shows as the engine's calls failing in the test itself.
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	return e, l.Addr().String()
}

// writes records what a client writes: every update and patch of an
// object, and every status write that changes something (Reconcile ends
// with a status patch, sent empty when nothing changed).
type writes struct {
	client.Client
	mu  sync.Mutex
	log []string
}

func (w *writes) add(s string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.log = append(w.log, s)
}

func (w *writes) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := w.log
	w.log = nil
	return out
}

func (w *writes) Update(ctx context.Context, o client.Object, opts ...client.UpdateOption) error {
	w.add("update " + o.GetName())
	return w.Client.Update(ctx, o, opts...)
}

func (w *writes) Patch(ctx context.Context, o client.Object, p client.Patch, opts ...client.PatchOption) error {
	w.add("patch " + o.GetName())
	return w.Client.Patch(ctx, o, p, opts...)
}

func (w *writes) Status() client.SubResourceWriter { return statusWrites{w.Client.Status(), w} }

type statusWrites struct {
	client.SubResourceWriter
	w *writes
}

func (s statusWrites) Patch(ctx context.Context, o client.Object, p client.Patch, opts ...client.SubResourcePatchOption) error {
	if data, err := p.Data(o); err != nil || string(data) != "{}" {
		s.w.add(fmt.Sprintf("patch status of %s: %s", o.GetName(), data))
	}
	return s.SubResourceWriter.Patch(ctx, o, p, opts...)
}

func (s statusWrites) Update(ctx context.Context, o client.Object, opts ...client.SubResourceUpdateOption) error {
	s.w.add("update status of " + o.GetName())
	return s.SubResourceWriter.Update(ctx, o, opts...)
}

type rig struct {
	t *testing.T
	g *WithT
	w *writes
	r *Reconciler
}

func newRig(t *testing.T) *rig {
	w := &writes{Client: k8sClient}
	return &rig{t: t, g: NewWithT(t), w: w, r: &Reconciler{Client: w}}
}

func (r *rig) reconcile(name string) error {
	r.t.Helper()
	_, err := r.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: "default", Name: name}})
	return err
}

func (r *rig) get(name string) *v1.Snapshot {
	r.t.Helper()
	s := &v1.Snapshot{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, s)).To(Succeed())
	return s
}

func (r *rig) gone(name string) bool {
	err := k8sClient.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, &v1.Snapshot{})
	return apierrors.IsNotFound(err)
}

// volume creates a Volume (mutate may set more of it first).
func (r *rig) volume(name string, mutate func(*v1.Volume)) *v1.Volume {
	r.t.Helper()
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.VolumeSpec{Size: resource.MustParse("16Mi"), NumberOfReplicas: 2}}
	if mutate != nil {
		mutate(v)
	}
	r.g.Expect(k8sClient.Create(context.Background(), v)).To(Succeed())
	return v
}

// engineObject creates v's Engine with the status its reconciler would
// report for an engine at addr in state st holding replicas in modes.
func (r *rig) engineObject(v *v1.Volume, addr string, st v1.InstanceState, modes map[string]v1.ReplicaMode) {
	r.t.Helper()
	ctx := context.Background()
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: volumes.EngineName(v), Namespace: "default"},
		Spec: v1.EngineSpec{VolumeName: v.Name, NodeName: "n1", Size: v.Spec.Size, DesiredState: v1.DesiredInstanceStateRunning}}
	r.g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	e.Status.InstanceState, e.Status.Address, e.Status.ReplicaModeMap = st, addr, modes
	r.g.Expect(k8sClient.Status().Update(ctx, e)).To(Succeed())
}

func (r *rig) snapshot(name, volume string, owners ...metav1.OwnerReference) {
	r.t.Helper()
	s := &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", OwnerReferences: owners}, Spec: v1.SnapshotSpec{Volume: volume}}
	r.g.Expect(k8sClient.Create(context.Background(), s)).To(Succeed())
}

func (r *rig) delete(name string) {
	r.t.Helper()
	r.g.Expect(k8sClient.Delete(context.Background(), &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"}})).To(Succeed())
}

func ready(s *v1.Snapshot) *metav1.Condition {
	return meta.FindStatusCondition(s.Status.Conditions, v1.SnapshotConditionReady)
}

func engineHas(t *testing.T, e *engine.Engine, name string) bool {
	t.Helper()
	snaps, err := e.Snapshots(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(snaps, func(s engine.SnapshotInfo) bool { return s.Name == name && s.UserCreated })
}

// TestTakeAndDelete: a Snapshot of a volume whose engine runs is taken on
// the engine once, reported ready with its time and size, and owned by
// its volume; reconciled again it writes nothing (not even with another
// owner reference whose fields are pointers); a name the engine already
// has (its answer was lost) is found and reported; deleted, it goes from
// the engine and then its object goes, except while a clone copies it.
func TestTakeAndDelete(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	e, addr := startEngine(t)
	v := r.volume("vol-a", nil)
	r.engineObject(v, addr, v1.InstanceStateRunning, map[string]v1.ReplicaMode{"vol-a-r1": v1.ReplicaModeRW, "vol-a-r2": v1.ReplicaModeRW})
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "backup-plan", Namespace: "default"}}
	r.g.Expect(k8sClient.Create(ctx, cm)).To(Succeed())
	// Best effort: the ConfigMap's name is this test's alone.
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, cm) })
	r.snapshot("s1", v.Name, metav1.OwnerReference{APIVersion: "v1", Kind: "ConfigMap", Name: cm.Name, UID: cm.UID, BlockOwnerDeletion: ptr.To(true)})

	r.g.Expect(r.reconcile("s1")).To(Succeed())
	s := r.get("s1")
	r.g.Expect(s.Status.ReadyToUse).To(BeTrue())
	r.g.Expect(s.Status.CreationTime).NotTo(BeNil())
	r.g.Expect(s.Status.Size.String()).To(Equal("16Mi"))
	r.g.Expect(ready(s).Reason).To(Equal(v1.SnapshotReasonTaken))
	r.g.Expect(ready(s).Message).To(ContainSubstring("taken on the 2 replicas volume vol-a's engine holds ([vol-a-r1 vol-a-r2])"))
	r.g.Expect(s.Finalizers).To(ContainElement(Finalizer))
	r.g.Expect(s.Labels).To(HaveKeyWithValue(volumes.LabelVolume, v.Name))
	r.g.Expect(s.OwnerReferences).To(ContainElement(HaveField("UID", v.UID)))
	r.g.Expect(s.OwnerReferences).To(ContainElement(HaveField("UID", cm.UID)), "another owner is kept")
	r.g.Expect(engineHas(t, e, "s1")).To(BeTrue())
	r.w.take()
	for range 2 {
		r.g.Expect(r.reconcile("s1")).To(Succeed())
		r.g.Expect(r.w.take()).To(BeEmpty(), "a taken snapshot is written again")
	}

	// Taken before a crash that lost the answer: found by name.
	r.g.Expect(e.Snapshot(ctx, "s2")).To(Succeed())
	r.snapshot("s2", v.Name)
	r.g.Expect(r.reconcile("s2")).To(Succeed())
	r.g.Expect(r.get("s2").Status.ReadyToUse).To(BeTrue())

	r.delete("s1")
	r.g.Expect(r.reconcile("s1")).To(Succeed())
	r.g.Expect(engineHas(t, e, "s1")).To(BeFalse(), "deleted from the engine's replicas")
	r.g.Expect(r.gone("s1")).To(BeTrue(), "the object goes once its data is gone")

	// A clone still copying s2 holds its deletion.
	clone := r.volume("vol-a-clone", func(c *v1.Volume) { c.Spec.DataSource = &v1.VolumeDataSource{Volume: v.Name, Snapshot: "s2"} })
	r.delete("s2")
	r.g.Expect(r.reconcile("s2")).To(Succeed())
	r.g.Expect(engineHas(t, e, "s2")).To(BeTrue())
	r.g.Expect(ready(r.get("s2")).Message).To(ContainSubstring("volume vol-a-clone is being cloned from this snapshot"))
	r.g.Expect(k8sClient.Delete(ctx, clone)).To(Succeed())
	r.g.Expect(r.reconcile("s2")).To(Succeed())
	r.g.Expect(engineHas(t, e, "s2")).To(BeFalse())
	r.g.Expect(r.gone("s2")).To(BeTrue())
}

// TestWaits: a Snapshot that cannot be taken yet says why in its Ready
// condition, touches no engine and is taken by no later reconcile until
// the cause is gone; one of a missing volume is let go at once when
// deleted.
func TestWaits(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	detached := r.volume("vol-w", nil)
	stopped := r.volume("vol-stopped", nil)
	r.engineObject(stopped, "127.0.0.1:1", v1.InstanceStateStopped, nil)
	rebuilding := r.volume("vol-wo", nil)
	r.engineObject(rebuilding, "127.0.0.1:1", v1.InstanceStateRunning, map[string]v1.ReplicaMode{"vol-wo-r1": v1.ReplicaModeWO})
	filling := r.volume("vol-fill", func(v *v1.Volume) { v.Spec.DataSource = &v1.VolumeDataSource{Volume: "vol-w"} })
	for _, tc := range []struct{ snap, volume, reason, msg string }{
		{"on-nothing", "nope", v1.SnapshotReasonVolumeNotFound, "volume nope does not exist in namespace default"},
		{"on-detached", detached.Name, v1.SnapshotReasonPending, "volume vol-w has no engine yet"},
		{"on-stopped", stopped.Name, v1.SnapshotReasonPending, "waiting for volume vol-stopped's engine to run (it is stopped)"},
		{"on-wo", rebuilding.Name, v1.SnapshotReasonPending, "has not reported an RW replica yet"},
		{"on-filling", filling.Name, v1.SnapshotReasonPending, "volume vol-fill is being filled from its data source"},
	} {
		r.snapshot(tc.snap, tc.volume)
		r.g.Expect(r.reconcile(tc.snap)).To(Succeed(), tc.snap)
		s := r.get(tc.snap)
		r.g.Expect(s.Status.ReadyToUse).To(BeFalse(), tc.snap)
		r.g.Expect(ready(s).Reason).To(Equal(tc.reason), tc.snap)
		r.g.Expect(ready(s).Message).To(ContainSubstring(tc.msg), tc.snap)
		r.g.Expect(s.Finalizers).To(ContainElement(Finalizer), tc.snap)
	}
	r.g.Expect(r.get("on-nothing").OwnerReferences).To(BeEmpty(), "no owner without a volume")

	r.delete("on-nothing")
	r.g.Expect(r.reconcile("on-nothing")).To(Succeed())
	r.g.Expect(r.gone("on-nothing")).To(BeTrue(), "nothing to delete for a volume that does not exist")
	r.delete("on-filling")
	r.g.Expect(r.reconcile("on-filling")).To(Succeed())
	r.g.Expect(r.gone("on-filling")).To(BeTrue(), "a volume still being filled has taken no snapshot")
	r.delete("on-stopped")
	r.g.Expect(r.reconcile("on-stopped")).To(Succeed())
	r.g.Expect(r.gone("on-stopped")).To(BeFalse(), "deleting waits for the engine")
	r.g.Expect(ready(r.get("on-stopped")).Message).To(HavePrefix("deleting: waiting for volume vol-stopped's engine"))
	// Let it go with its volume: its data goes with the volume's.
	r.g.Expect(k8sClient.Delete(ctx, stopped)).To(Succeed())
	r.g.Expect(r.reconcile("on-stopped")).To(Succeed())
	r.g.Expect(r.gone("on-stopped")).To(BeTrue())
}

// TestEngineUnreachable: an engine that does not answer fails the take
// with an error to retry and a Ready condition that says so.
func TestEngineUnreachable(t *testing.T) {
	r := newRig(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	r.g.Expect(err).NotTo(HaveOccurred())
	addr := l.Addr().String()
	l.Close()
	v := r.volume("vol-down", nil)
	r.engineObject(v, addr, v1.InstanceStateRunning, map[string]v1.ReplicaMode{"vol-down-r1": v1.ReplicaModeRW})
	r.snapshot("down", v.Name)
	err = r.reconcile("down")
	r.g.Expect(grpcstatus.Code(err)).To(Equal(codes.Unavailable))
	s := r.get("down")
	r.g.Expect(s.Status.ReadyToUse).To(BeFalse())
	r.g.Expect(ready(s).Reason).To(Equal(v1.SnapshotReasonFailed))
	r.g.Expect(ready(s).Message).To(ContainSubstring("taking the snapshot on volume vol-down's engine failed (it is retried)"))
}
