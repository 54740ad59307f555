package main

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// pluginNS is where TestPlugin's Cairn objects are.
const pluginNS = "cairn-system"

// pluginSize is the size of every volume, replica and claim in TestPlugin.
var pluginSize = resource.MustParse("1Gi")

// The plugin runs against a real API server (envtest) holding the objects
// a cluster would: a healthy attached volume, a degraded one with a
// replica being rebuilt and one whose node is gone, an unschedulable one,
// snapshots and an event. The subtests run in order on the same objects
// (salvage deletes a replica).
func TestPlugin(t *testing.T) {
	p := &pluginRig{t: t, ctx: context.Background(), cl: startAPI(t)}
	p.must(p.cl.c.Create(p.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: pluginNS}}))
	p.seedInstanceManagers()
	p.seedHealthyAndDegraded()
	p.seedUnscheduledAndFaulted()
	p.seedSnapshotAndEvent()
	p.seedClaims()

	t.Run("volumes", p.testVolumes)
	t.Run("rebuilds and snapshots", p.testRebuildsAndSnapshots)
	t.Run("doctor", p.testDoctor)
	t.Run("salvage", p.testSalvage)
	t.Run("drain-check", p.testDrainCheck)
	t.Run("bad use", p.testBadUse)
}

// pluginRig holds TestPlugin's API server; t is TestPlugin's, for seeding.
type pluginRig struct {
	t   *testing.T
	ctx context.Context
	cl  *clients
}

func (p *pluginRig) must(err error) {
	p.t.Helper()
	if err != nil {
		p.t.Fatal(err)
	}
}

// create makes o and then sets its status to what status does to it.
func (p *pluginRig) create(o client.Object, status func()) {
	p.t.Helper()
	p.must(p.cl.c.Create(p.ctx, o))
	if status != nil {
		status()
		p.must(p.cl.c.Status().Update(p.ctx, o))
	}
}

func cond(typ string, ok bool, reason, msg string) metav1.Condition {
	s := metav1.ConditionFalse
	if ok {
		s = metav1.ConditionTrue
	}
	return metav1.Condition{Type: typ, Status: s, Reason: reason, Message: msg, LastTransitionTime: metav1.Now()}
}

// running is a Replica's Ready condition while it runs.
var running = cond(v1.ConditionReady, true, "AsExpected", "running")

func (p *pluginRig) volume(name, node string, status func(*v1.Volume)) {
	p.t.Helper()
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pluginNS}, Spec: v1.VolumeSpec{Size: pluginSize, NumberOfReplicas: 3, NodeName: node}}
	p.create(v, func() { status(v) })
}

func (p *pluginRig) engine(vol, node string, modes map[string]v1.ReplicaMode, rebuild map[string]v1.RebuildStatus) {
	p.t.Helper()
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: vol + "-e", Namespace: pluginNS}, Spec: v1.EngineSpec{VolumeName: vol, NodeName: node,
		DesiredState: v1.DesiredInstanceStateRunning, Size: pluginSize}}
	p.create(e, func() {
		e.Status.InstanceState = v1.InstanceStateRunning
		e.Status.InstanceManagerName = "im-" + node
		e.Status.ReplicaModeMap, e.Status.RebuildStatus = modes, rebuild
		e.Status.Conditions = []metav1.Condition{cond(v1.ConditionReady, true, "AsExpected", "serving")}
	})
}

func (p *pluginRig) replica(name, vol, node string, state v1.InstanceState, ready metav1.Condition) {
	p.t.Helper()
	r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: pluginNS}, Spec: v1.ReplicaSpec{VolumeName: vol, NodeName: node,
		Size: pluginSize, DesiredState: v1.DesiredInstanceStateRunning}}
	if node == "" {
		r.Spec.DesiredState = v1.DesiredInstanceStateStopped
	}
	p.create(r, func() {
		r.Status.InstanceState = state
		r.Status.Conditions = []metav1.Condition{ready}
	})
}

// seedInstanceManagers: nodes a and b run theirs, c's is unknown.
func (p *pluginRig) seedInstanceManagers() {
	for _, n := range []string{"a", "b"} {
		im := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + n, Namespace: pluginNS}, Spec: v1.InstanceManagerSpec{NodeName: n, Address: "10.0.0.1:8500"}}
		p.create(im, func() { im.Status.State = v1.InstanceManagerStateRunning })
	}
	imC := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-c", Namespace: pluginNS}, Spec: v1.InstanceManagerSpec{NodeName: "c"}}
	p.create(imC, func() { imC.Status.State = v1.InstanceManagerStateUnknown })
}

// seedHealthyAndDegraded: good is attached and healthy; sick is degraded,
// rebuilding sick-r-1 with sick-r-2 on the unknown node c.
func (p *pluginRig) seedHealthyAndDegraded() {
	p.volume("good", "a", func(v *v1.Volume) {
		v.Status.State, v.Status.Robustness, v.Status.CurrentNodeName = v1.VolumeStateAttached, v1.VolumeRobustnessHealthy, "a"
		used := resource.MustParse("300Mi")
		v.Status.ActualSize = &used
		v.Status.Conditions = []metav1.Condition{cond(v1.VolumeConditionScheduled, true, "AsExpected", "all placed")}
	})
	p.engine("good", "a", map[string]v1.ReplicaMode{"good-r-0": v1.ReplicaModeRW, "good-r-1": v1.ReplicaModeRW}, nil)
	p.replica("good-r-0", "good", "a", v1.InstanceStateRunning, running)
	p.replica("good-r-1", "good", "b", v1.InstanceStateRunning, running)

	p.volume("sick", "a", func(v *v1.Volume) {
		v.Status.State, v.Status.Robustness, v.Status.CurrentNodeName = v1.VolumeStateAttached, v1.VolumeRobustnessDegraded, "a"
		v.Status.Conditions = []metav1.Condition{cond(v1.VolumeConditionRebuilding, true, "InProgress", "sick-r-1: 25%")}
	})
	p.engine("sick", "a", map[string]v1.ReplicaMode{"sick-r-0": v1.ReplicaModeRW, "sick-r-1": v1.ReplicaModeWO},
		map[string]v1.RebuildStatus{"sick-r-1": {State: v1.RebuildStateInProgress, SourceReplica: "sick-r-0", BytesDone: 256 << 20, BytesTotal: 1 << 30, DirtyOnly: true}})
	p.replica("sick-r-0", "sick", "a", v1.InstanceStateRunning, running)
	p.replica("sick-r-1", "sick", "b", v1.InstanceStateRunning, running)
	p.replica("sick-r-2", "sick", "c", v1.InstanceStateUnknown, cond(v1.ConditionReady, false, "InstanceManagerNotCurrent", "the instance manager on c does not answer"))
}

// seedUnscheduledAndFaulted: homeless has no disk for its replicas; dead
// is faulted, its salvage waiting for dead-r-1 on c.
func (p *pluginRig) seedUnscheduledAndFaulted() {
	p.volume("homeless", "", func(v *v1.Volume) {
		v.Status.State, v.Status.Robustness = v1.VolumeStateDetached, v1.VolumeRobustnessUnknown
		v.Status.Conditions = []metav1.Condition{cond(v1.VolumeConditionScheduled, false, "NoDisk", "2 of 3 replicas unplaced: no disk with 1Gi free")}
	})
	p.replica("homeless-r-0", "homeless", "", v1.InstanceStateStopped, cond(v1.ConditionReady, false, "Unscheduled", "no disk"))

	p.volume("dead", "a", func(v *v1.Volume) {
		v.Status.State, v.Status.Robustness = v1.VolumeStateAttaching, v1.VolumeRobustnessFaulted
		v.Status.Conditions = []metav1.Condition{cond(v1.ConditionReady, false, "Faulted", "no replica is RW; salvage waits for every replica that held the volume's data to run again (dead-r-1)")}
	})
	p.replica("dead-r-0", "dead", "a", v1.InstanceStateRunning, running)
	p.replica("dead-r-1", "dead", "c", v1.InstanceStateUnknown, cond(v1.ConditionReady, false, "InstanceManagerNotCurrent", "gone"))
}

// seedSnapshotAndEvent: a ready snapshot of good, a warning about sick.
func (p *pluginRig) seedSnapshotAndEvent() {
	snap := &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: "nightly", Namespace: pluginNS}, Spec: v1.SnapshotSpec{Volume: "good"}}
	p.create(snap, func() {
		snap.Status.ReadyToUse = true
		q := resource.MustParse("1Gi")
		snap.Status.Size = &q
		snap.Status.CreationTime = &metav1.Time{Time: metav1.Now().Time}
	})
	p.must(p.cl.c.Create(p.ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "sick.1", Namespace: pluginNS},
		InvolvedObject: corev1.ObjectReference{Kind: "Volume", Name: "sick", Namespace: pluginNS}, Type: corev1.EventTypeWarning,
		Reason: "ReplicaFailed", Message: "replica sick-r-2 failed: connection refused", LastTimestamp: metav1.Now()}))
}

// seedClaims: good's, provisioned by Cairn's driver and bound; one not
// bound yet; one of another driver.
func (p *pluginRig) seedClaims() {
	p.must(p.cl.c.Create(p.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}))
	claim := func(name, pv string, bound bool) {
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "app"}, Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: pv,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: pluginSize}}}}
		p.create(pvc, func() {
			if bound {
				pvc.Status.Phase = corev1.ClaimBound
			}
		})
	}
	persistentVolume := func(name, driver, handle, claim string) {
		p.must(p.cl.c.Create(p.ctx, &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeSpec{
			Capacity: corev1.ResourceList{corev1.ResourceStorage: pluginSize}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: handle}},
			ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "app", Name: claim}}}))
	}
	claim("data", "good", true)
	persistentVolume("good", "storage.cairn.io", "good", "data")
	claim("waiting", "", false)
	claim("share", "nfs-share", true)
	persistentVolume("nfs-share", "nfs.csi.k8s.io", "share-1", "share")
}

// kc runs the plugin with args and returns its stdout and stderr together,
// and its exit code.
func (p *pluginRig) kc(args ...string) (string, int) {
	var out, errb bytes.Buffer
	code := run(p.ctx, args, &out, &errb, p.cl)
	return out.String() + errb.String(), code
}

// exists says whether the Replica name is still there.
func (p *pluginRig) exists(name string) bool {
	return p.cl.c.Get(p.ctx, client.ObjectKey{Namespace: pluginNS, Name: name}, &v1.Replica{}) == nil
}

func contains(t *testing.T, out string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
}

func (p *pluginRig) testVolumes(t *testing.T) {
	out, code := p.kc("volumes")
	if code != 0 {
		t.Fatalf("volumes: %d %s", code, out)
	}
	contains(t, out, "NAME", "CLAIM", "good", "attached", "healthy", "├─ engine/good-e", "replica/good-r-1", "└─ replica/sick-r-2", "rebuilding", "unscheduled")
	for _, line := range strings.Split(out, "\n") {
		checkVolumesLine(t, line)
	}

	out, code = p.kc("-o", "json", "volumes")
	var vs []volumeView
	if code != 0 || json.Unmarshal([]byte(out), &vs) != nil || len(vs) != 4 || vs[1].Name != "good" || vs[1].Claim != "app/data" || len(vs[1].Replicas) != 2 {
		t.Fatalf("volumes -o json: %d %s", code, out)
	}
	out, _ = p.kc("volumes", "-o", "yaml")
	contains(t, out, "- engine:", "name: good-e", "robustness: degraded")
}

// checkVolumesLine checks one line of the volumes table: good's columns,
// sick's missing claim, good-r-1's node, mode and health.
func checkVolumesLine(t *testing.T, line string) {
	t.Helper()
	if f := strings.Fields(line); len(f) > 0 && f[0] == "good" && !slices.Equal(f[1:7], []string{"app/data", "attached", "healthy", "1Gi", "300Mi", "a"}) {
		t.Errorf("good's line (claim, state, robustness, size, used, node): %q", line)
	}
	if f := strings.Fields(line); len(f) > 0 && f[0] == "sick" && f[1] != "-" {
		t.Errorf("sick has no claim: %q", line)
	}
	if strings.Contains(line, "replica/good-r-1") && (!strings.Contains(line, " b ") || !strings.Contains(line, "RW") || !strings.Contains(line, "healthy")) {
		t.Errorf("good-r-1's line: %q", line)
	}
}

func (p *pluginRig) testRebuildsAndSnapshots(t *testing.T) {
	out, code := p.kc("rebuilds")
	if code != 0 {
		t.Fatalf("rebuilds: %d %s", code, out)
	}
	contains(t, out, "sick", "sick-r-1", "sick-r-0", "changed regions", "in-progress", "[#####...............]  25%", "256.0 MiB / 1.0 GiB")

	out, _ = p.kc("snapshots", "good")
	contains(t, out, "nightly", "good", "true", "1Gi")
	out, _ = p.kc("snapshots", "homeless")
	contains(t, out, "No snapshots")
}

func (p *pluginRig) testDoctor(t *testing.T) {
	out, code := p.kc("doctor", "good")
	if code != 0 {
		t.Fatalf("doctor good: %d %s", code, out)
	}
	contains(t, out, "Volume good (claim app/data): attached, healthy", "Nothing wrong found")
	// A claim stands for its volume; a claim that has none says why.
	out, code = p.kc("doctor", "app/data")
	if code != 0 {
		t.Fatalf("doctor app/data: %d %s", code, out)
	}
	contains(t, out, "Volume good (claim app/data): attached, healthy", "Nothing wrong found")
	for _, tc := range []struct{ claim, says string }{
		{"app/nope", "no PersistentVolumeClaim nope in namespace app: check the name with `kubectl -n app get pvc`"},
		{"app/waiting", "claim app/waiting is Pending, not bound to a volume yet"},
		{"app/share", "claim app/share is bound to PersistentVolume nfs-share of driver nfs.csi.k8s.io, not of Cairn's driver storage.cairn.io"},
	} {
		if out, code = p.kc("doctor", tc.claim); code != 1 || !strings.Contains(out, tc.says) {
			t.Errorf("doctor %s: exit %d (want 1), want %q in:\n%s", tc.claim, code, tc.says, out)
		}
	}
	out, code = p.kc("doctor", "sick")
	if code != 3 {
		t.Fatalf("doctor sick exits %d, want 3 (not healthy):\n%s", code, out)
	}
	contains(t, out, "degraded", "a replica is being rebuilt", "rebuilds --watch", "replica sick-r-2 on c is unknown",
		"instance manager im-c on c is unknown", "ReplicaFailed: replica sick-r-2 failed")
	out, code = p.kc("doctor", "homeless")
	contains(t, out, "not every replica has a disk: 2 of 3 replicas unplaced", "add nodes or disks")
	if code != 3 {
		t.Fatalf("doctor homeless exits %d", code)
	}
	out, code = p.kc("doctor", "nope")
	if code != 1 || !strings.Contains(out, "no volume nope in cairn-system (for a claim, give NAMESPACE/CLAIM") {
		t.Fatalf("doctor of a missing volume: %d %s", code, out)
	}
}

// testSalvage: what salvage waits for; giving up on a replica needs --yes
// and a real replica of the volume; a healthy volume is left alone.
func (p *pluginRig) testSalvage(t *testing.T) {
	out, code := p.kc("salvage", "dead")
	if code != 0 {
		t.Fatalf("salvage dead: %d %s", code, out)
	}
	contains(t, out, "faulted", "salvage waits for", "dead-r-1", "im-c unknown", "kubectl cairn salvage dead --give-up dead-r-1 --yes")
	out, _ = p.kc("salvage", "dead", "--give-up", "dead-r-1")
	contains(t, out, "Would delete dead-r-1")
	if !p.exists("dead-r-1") {
		t.Fatal("deleted without --yes")
	}
	if out, code = p.kc("salvage", "dead", "--give-up", "good-r-0", "--yes"); code != 1 || !strings.Contains(out, "not a replica of dead") {
		t.Fatalf("another volume's replica: %d %s", code, out)
	}
	if out, code = p.kc("salvage", "dead", "--give-up", "dead-r-0,dead-r-1", "--yes"); code != 1 || !strings.Contains(out, "every replica") {
		t.Fatalf("every replica: %d %s", code, out)
	}
	if out, code = p.kc("salvage", "good", "--give-up", "good-r-0", "--yes"); code != 1 || !p.exists("good-r-0") {
		t.Fatalf("a healthy volume's replica: %d %s", code, out)
	}
	out, code = p.kc("salvage", "dead", "--give-up", "dead-r-1", "--yes")
	if code != 0 || p.exists("dead-r-1") || !p.exists("dead-r-0") {
		t.Fatalf("salvage --give-up --yes: %d %s", code, out)
	}
	contains(t, out, "replica dead-r-1 deleted")
}

// testDrainCheck: node a runs good's and sick's engines and holds sick's
// only RW replica (sick-r-1 on b is still WO); b holds nothing that is
// the last healthy copy of anything.
func (p *pluginRig) testDrainCheck(t *testing.T) {
	out, code := p.kc("drain-check", "a")
	if code != 3 {
		t.Fatalf("drain-check a: %d %s", code, out)
	}
	contains(t, out, "a drain waits", "good", "EngineRunning", "engine good-e runs on a", "LastHealthyReplica", "(sick-r-0)")
	if strings.Count(out, "EngineRunning") != 2 || strings.Count(out, "LastHealthyReplica") != 1 {
		t.Errorf("drain-check a: two engines and one last healthy replica:\n%s", out)
	}
	if err := p.cl.c.Create(p.ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "b"}, Spec: corev1.NodeSpec{Unschedulable: true}}); err != nil {
		t.Fatal(err)
	}
	out, code = p.kc("drain-check", "b")
	if code != 0 {
		t.Fatalf("drain-check b: %d %s", code, out)
	}
	contains(t, out, "node b (cordoned) holds 2 replicas", "it can be drained")
	out, code = p.kc("-o", "json", "drain-check", "a")
	var dv drainView
	if code != 3 || json.Unmarshal([]byte(out), &dv) != nil || dv.Safe || len(dv.Blockers) != 3 || dv.Blockers[0].Volume != "good" {
		t.Fatalf("drain-check -o json: %d %s", code, out)
	}
	if _, code = p.kc("drain-check"); code != 2 {
		t.Fatal("drain-check without a node should exit 2")
	}
}

// testBadUse: another namespace has no volumes; an unknown command and
// an unknown output format are refused.
func (p *pluginRig) testBadUse(t *testing.T) {
	out, code := p.kc("-n", "elsewhere", "volumes")
	if code != 0 {
		t.Errorf("volumes in a namespace without any: exit %d, want 0:\n%s", code, out)
	}
	contains(t, out, "No volumes in elsewhere")
	if _, code = p.kc("frobnicate"); code != 2 {
		t.Fatal("an unknown command should exit 2")
	}
	if _, code = p.kc("-o", "xml", "volumes"); code != 2 {
		t.Fatal("-o xml should exit 2")
	}
}

// TestKeyCheck: key-check prints the check the CSI driver records for a
// passphrase, with or without echo's newline, and refuses a short one.
func TestKeyCheck(t *testing.T) {
	const pass = "correct horse battery staple"
	key, err := volcrypt.DeriveKey([]byte(pass))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range []string{pass, pass + "\n"} {
		stdin = strings.NewReader(in)
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{"key-check"}, &out, &errb, nil); code != 0 || strings.TrimSpace(out.String()) != volcrypt.KeyCheck(key) {
			t.Fatalf("key-check of %q: exit %d, %q (want %s) %s", in, code, out.String(), volcrypt.KeyCheck(key), errb.String())
		}
	}
	stdin = strings.NewReader("too short\n")
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"key-check"}, &out, &errb, nil); code != 2 || out.Len() != 0 || !strings.Contains(errb.String(), "16 to 4096 bytes") {
		t.Fatalf("a short passphrase: exit %d, %q, %q", code, out.String(), errb.String())
	}
}
