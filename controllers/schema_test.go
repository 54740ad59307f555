package controllers

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

const ns = "default"

var seq int

// name returns a fresh object name so tests never collide.
func name(prefix string) string {
	seq++
	return fmt.Sprintf("%s-%d", prefix, seq)
}

func now() metav1.Time { return metav1.NewTime(time.Now().UTC().Truncate(time.Second)) }

func q(s string) resource.Quantity { return resource.MustParse(s) }

func qp(s string) *resource.Quantity { return ptr.To(resource.MustParse(s)) }

func cond(typ string) metav1.Condition {
	return metav1.Condition{
		Type: typ, Status: metav1.ConditionTrue, Reason: v1.ReasonAsExpected,
		Message: "all good", LastTransitionTime: now(), ObservedGeneration: 1,
	}
}

// TestRoundTrip stores a fully populated object of every kind, spec and
// status, and checks that reading it back gives the same thing: no field is
// dropped by the schema (pruning) or altered by defaulting.
func TestRoundTrip(t *testing.T) {
	ts := now()
	cases := []struct {
		obj    client.Object
		status func(client.Object) // fills status before the status update
		get    client.Object
	}{
		{
			obj: &v1.Volume{Spec: v1.VolumeSpec{
				Size: q("10Gi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, NodeName: "worker-1",
				DataSource: &v1.VolumeDataSource{Volume: "origin", Snapshot: "snap-1"},
				AccessMode: v1.VolumeAccessModeReadWriteOncePod,
			}},
			status: func(o client.Object) {
				o.(*v1.Volume).Status = v1.VolumeStatus{
					ObservedGeneration: 1, State: v1.VolumeStateAttached, Robustness: v1.VolumeRobustnessDegraded,
					CurrentNodeName: "worker-1", Endpoint: "/dev/loop3", Size: qp("10Gi"), ActualSize: qp("123Mi"),
					Conditions: []metav1.Condition{cond(v1.VolumeConditionScheduled), cond(v1.ConditionReady)},
				}
			},
			get: &v1.Volume{},
		},
		{
			obj: &v1.Volume{Spec: v1.VolumeSpec{
				Size: q("10Gi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD, AccessMode: v1.VolumeAccessModeReadWriteOnce,
				DataSource: &v1.VolumeDataSource{Backup: &v1.VolumeBackupSource{Target: "offsite", Volume: "db-data", Name: "db-data-20261127"}},
			}},
			status: func(o client.Object) {
				o.(*v1.Volume).Status = v1.VolumeStatus{
					ObservedGeneration: 1, State: v1.VolumeStateDetached, Robustness: v1.VolumeRobustnessUnknown,
					Clone: &v1.CloneStatus{State: v1.CloneStateCopying, Backup: &v1.VolumeBackupSource{Target: "offsite", Volume: "db-data", Name: "db-data-20261127"},
						Progress: 41, BytesDone: 9126805504, BytesTotal: 22011707392, Message: "writing"},
					Conditions: []metav1.Condition{cond(v1.VolumeConditionScheduled)},
				}
			},
			get: &v1.Volume{},
		},
		{
			obj: &v1.Engine{Spec: v1.EngineSpec{
				VolumeName: "vol", NodeName: "worker-1", DesiredState: v1.DesiredInstanceStateRunning,
				Size: q("1Gi"), Frontend: v1.FrontendFUSE,
				ReplicaAddresses: map[string]v1.ReplicaAddress{"vol-r-a": {Data: "10.0.0.1:10000", Control: "10.0.0.1:10001"}, "vol-r-b": {Data: "unix:/run/cairn/r.sock", Control: "10.0.0.2:10001"}},
			}},
			status: func(o client.Object) {
				o.(*v1.Engine).Status = v1.EngineStatus{
					ObservedGeneration: 1, InstanceState: v1.InstanceStateRunning, InstanceManagerName: "im-worker-1",
					Address: "10.0.0.1:10010", Endpoint: "/dev/loop3", Size: qp("1Gi"),
					ReplicaModeMap: map[string]v1.ReplicaMode{"vol-r-a": v1.ReplicaModeRW, "vol-r-b": v1.ReplicaModeWO},
					RebuildStatus: map[string]v1.RebuildStatus{"vol-r-b": {
						State: v1.RebuildStateInProgress, SourceReplica: "vol-r-a", BytesDone: 512, BytesTotal: 1024,
						Progress: 50, StartedAt: &ts,
					}},
					Snapshots: map[string]v1.SnapshotInfo{"snap-1": {
						Name: "snap-1", Parent: "snap-0", CreatedAt: &ts, Size: qp("4Mi"), UserCreated: true,
					}},
					Conditions: []metav1.Condition{cond(v1.ConditionReady)},
				}
			},
			get: &v1.Engine{},
		},
		{
			obj: &v1.Replica{Spec: v1.ReplicaSpec{
				VolumeName: "vol", NodeName: "worker-2", DiskName: "data1", DiskPath: "/var/lib/cairn",
				DataDirectoryName: "vol-3f2a9c", Size: q("1Gi"), DesiredState: v1.DesiredInstanceStateRunning,
				FailedAt: &ts, HealthyAt: &ts,
			}},
			status: func(o client.Object) {
				o.(*v1.Replica).Status = v1.ReplicaStatus{
					ObservedGeneration: 1, InstanceState: v1.InstanceStateError, InstanceManagerName: "im-worker-2",
					Address: "10.0.0.2:10000", ControlAddress: "10.0.0.2:10001", Conditions: []metav1.Condition{cond(v1.ConditionReady)},
				}
			},
			get: &v1.Replica{},
		},
		{
			obj: &v1.InstanceManager{Spec: v1.InstanceManagerSpec{
				NodeName: "worker-1", Image: "cairn:dev", Address: "10.0.0.1:8500",
			}},
			status: func(o client.Object) {
				o.(*v1.InstanceManager).Status = v1.InstanceManagerStatus{
					ObservedGeneration: 1, State: v1.InstanceManagerStateRunning, Version: "dev",
					Processes: []v1.ProcessStatus{
						{Name: "vol-e-0", Kind: v1.ProcessKindEngine, State: v1.InstanceStateRunning, Ports: []int32{10010, 10011}},
						{Name: "vol-r-a", Kind: v1.ProcessKindReplica, State: v1.InstanceStateError, Ports: []int32{10000},
							ExitCode: ptr.To[int32](2), Error: "exit status 2: disk full"},
					},
					Conditions: []metav1.Condition{cond(v1.ConditionReady)},
				}
			},
			get: &v1.InstanceManager{},
		},
		{
			obj: &v1.StorageNode{Spec: v1.StorageNodeSpec{
				NodeName: "worker-1", AllowScheduling: ptr.To(false),
				Disks: []v1.DiskSpec{
					{Name: "data1", Path: "/var/lib/cairn", AllowScheduling: ptr.To(true), StorageReserved: qp("10Gi"), Tags: []string{"ssd", "fast"}},
					{Name: "data2", Path: "/mnt/disk2", AllowScheduling: ptr.To(false)},
				},
			}},
			status: func(o client.Object) {
				o.(*v1.StorageNode).Status = v1.StorageNodeStatus{
					ObservedGeneration: 1,
					Disks: []v1.DiskStatus{{
						Name: "data1", Filesystem: "ext4", Capacity: qp("100Gi"), Available: qp("60Gi"), Scheduled: qp("30Gi"),
						Conditions: []metav1.Condition{cond(v1.ConditionReady), cond(v1.StorageNodeConditionSchedulable)},
					}},
					Conditions: []metav1.Condition{cond(v1.ConditionReady)},
				}
			},
			get: &v1.StorageNode{},
		},
	}
	for _, tc := range cases {
		kind := fmt.Sprintf("%T", tc.obj)[len("*v1alpha1."):]
		t.Run(kind, func(t *testing.T) {
			g := NewWithT(t)
			tc.obj.SetName(name(strings.ToLower(kind)))
			tc.obj.SetNamespace(ns)
			g.Expect(k8sClient.Create(ctx, tc.obj)).To(Succeed())
			wantSpec := specOf(tc.obj)
			g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(tc.obj), tc.get)).To(Succeed())
			g.Expect(apiequality.Semantic.DeepEqual(specOf(tc.get), wantSpec)).To(BeTrue(),
				"spec changed in the round trip:\nwant %+v\n got %+v", wantSpec, specOf(tc.get))

			tc.status(tc.get)
			wantStatus := statusOf(tc.get)
			g.Expect(k8sClient.Status().Update(ctx, tc.get)).To(Succeed())
			fresh := tc.get.DeepCopyObject().(client.Object)
			g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(tc.obj), fresh)).To(Succeed())
			g.Expect(apiequality.Semantic.DeepEqual(statusOf(fresh), wantStatus)).To(BeTrue(),
				"status changed in the round trip:\nwant %+v\n got %+v", wantStatus, statusOf(fresh))
		})
	}
}

func specOf(o client.Object) any {
	switch o := o.(type) {
	case *v1.Volume:
		return o.Spec
	case *v1.Engine:
		return o.Spec
	case *v1.Replica:
		return o.Spec
	case *v1.InstanceManager:
		return o.Spec
	case *v1.StorageNode:
		return o.Spec
	}
	panic(fmt.Sprintf("unknown kind %T", o))
}

func statusOf(o client.Object) any {
	switch o := o.(type) {
	case *v1.Volume:
		return o.Status
	case *v1.Engine:
		return o.Status
	case *v1.Replica:
		return o.Status
	case *v1.InstanceManager:
		return o.Status
	case *v1.StorageNode:
		return o.Status
	}
	panic(fmt.Sprintf("unknown kind %T", o))
}

// TestDefaults checks the defaults the API server fills in.
func TestDefaults(t *testing.T) {
	g := NewWithT(t)
	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name("defaults"), Namespace: ns},
		Spec: v1.VolumeSpec{Size: q("1Mi")}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	g.Expect(vol.Spec.NumberOfReplicas).To(Equal(int32(3)))
	g.Expect(vol.Spec.Frontend).To(Equal(v1.FrontendFUSE))
	g.Expect(vol.Spec.AccessMode).To(Equal(v1.VolumeAccessModeReadWriteOnce))

	eng := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: name("defaults"), Namespace: ns},
		Spec: v1.EngineSpec{VolumeName: "v", Size: q("1Mi")}}
	g.Expect(k8sClient.Create(ctx, eng)).To(Succeed())
	g.Expect(eng.Spec.DesiredState).To(Equal(v1.DesiredInstanceStateStopped))

	// allowScheduling defaults to true but an explicit false must survive.
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: name("defaults"), Namespace: ns},
		Spec: v1.StorageNodeSpec{NodeName: "n", Disks: []v1.DiskSpec{
			{Name: "a", Path: "/a"}, {Name: "b", Path: "/b", AllowScheduling: ptr.To(false)},
		}}}
	g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
	g.Expect(sn.Spec.AllowScheduling).To(Equal(ptr.To(true)))
	g.Expect(sn.Spec.Disks[0].AllowScheduling).To(Equal(ptr.To(true)))
	g.Expect(sn.Spec.Disks[1].AllowScheduling).To(Equal(ptr.To(false)))
}

// u builds an unstructured object the way a user writes YAML, so that
// invalid values (zero replicas, bad enums) reach the API server as sent.
func u(kind string, spec map[string]any) *unstructured.Unstructured {
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": v1.GroupVersion.String(), "kind": kind,
		"metadata": map[string]any{"name": name(strings.ToLower(kind)), "namespace": ns},
		"spec":     spec,
	}}
	return obj
}

// TestInvalidSpecsRejected checks that the API server refuses bad specs on
// create, with a message that names the field and the rule.
func TestInvalidSpecsRejected(t *testing.T) {
	vol := func(kv ...any) map[string]any {
		spec := map[string]any{"size": "1Gi"}
		for i := 0; i < len(kv); i += 2 {
			if kv[i+1] == nil {
				delete(spec, kv[i].(string))
			} else {
				spec[kv[i].(string)] = kv[i+1]
			}
		}
		return spec
	}
	disk := func(name, path string) map[string]any { return map[string]any{"name": name, "path": path} }
	cases := []struct {
		name string
		obj  *unstructured.Unstructured
		want []string
	}{
		{"zero replicas", u("Volume", vol("numberOfReplicas", 0)),
			[]string{"spec.numberOfReplicas", "greater than or equal to 1"}},
		{"eleven replicas", u("Volume", vol("numberOfReplicas", 11)),
			[]string{"spec.numberOfReplicas", "less than or equal to 10"}},
		{"size below 1Mi", u("Volume", vol("size", "512Ki")),
			[]string{"spec.size", "size must be at least 1Mi"}},
		{"size not a multiple of 4096", u("Volume", vol("size", 1048577)),
			[]string{"spec.size", "divisible by 4096"}},
		{"fractional size", u("Volume", vol("size", "1.0000001Gi")),
			[]string{"spec.size", "divisible by 4096"}},
		{"size missing", u("Volume", vol("size", nil)),
			[]string{"spec.size", "Required value"}},
		{"unknown frontend", u("Volume", vol("frontend", "iscsi")),
			[]string{"spec.frontend", `Unsupported value: "iscsi"`, `"nbd"`, `"fuse"`}},
		{"unknown access mode", u("Volume", vol("accessMode", "ReadWriteMany")),
			[]string{"spec.accessMode", `Unsupported value: "ReadWriteMany"`}},
		{"data source without volume or backup", u("Volume", vol("dataSource", map[string]any{"snapshot": "s"})),
			[]string{"spec.dataSource", "set exactly one of volume (a clone) and backup (a restore)"}},
		{"data source with volume and backup", u("Volume", vol("dataSource", map[string]any{"volume": "v",
			"backup": map[string]any{"target": "t", "volume": "v", "name": "b"}})),
			[]string{"spec.dataSource", "set exactly one of volume (a clone) and backup (a restore)"}},
		{"backup with a snapshot", u("Volume", vol("dataSource", map[string]any{"snapshot": "s",
			"backup": map[string]any{"target": "t", "volume": "v", "name": "b"}})),
			[]string{"spec.dataSource", "a restore from a backup takes none"}},
		{"backup without name", u("Volume", vol("dataSource", map[string]any{"backup": map[string]any{"target": "t", "volume": "v"}})),
			[]string{"spec.dataSource.backup.name", "Required value"}},
		{"backup volume not a name", u("Volume", vol("dataSource", map[string]any{"backup": map[string]any{"target": "t", "volume": "../x", "name": "b"}})),
			[]string{"spec.dataSource.backup.volume", "should match"}},
		{"engine asked to be starting", u("Engine", map[string]any{"volumeName": "v", "size": "1Gi", "desiredState": "starting"}),
			[]string{"spec.desiredState", `Unsupported value: "starting"`}},
		{"engine without volume", u("Engine", map[string]any{"size": "1Gi"}),
			[]string{"spec.volumeName", "Required value"}},
		{"replica data directory escaping the disk", u("Replica", map[string]any{"volumeName": "v", "size": "1Gi", "dataDirectoryName": "../etc"}),
			[]string{"spec.dataDirectoryName", "should match"}},
		{"replica relative disk path", u("Replica", map[string]any{"volumeName": "v", "size": "1Gi", "diskPath": "var/lib"}),
			[]string{"spec.diskPath", "should match"}},
		{"instance manager without node", u("InstanceManager", map[string]any{"image": "cairn:dev"}),
			[]string{"spec.nodeName", "Required value"}},
		{"relative disk path", u("StorageNode", map[string]any{"nodeName": "n", "disks": []any{disk("a", "data")}}),
			[]string{"spec.disks[0].path", "should match"}},
		{"duplicate disk names", u("StorageNode", map[string]any{"nodeName": "n", "disks": []any{disk("a", "/x"), disk("a", "/y")}}),
			[]string{"spec.disks[1]", "Duplicate value"}},
		{"disk name not a DNS label", u("StorageNode", map[string]any{"nodeName": "n", "disks": []any{disk("Data_1", "/x")}}),
			[]string{"spec.disks[0].name", "should match"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := k8sClient.Create(ctx, tc.obj)
			g.Expect(err).To(HaveOccurred(), "the API server accepted an invalid %s", tc.obj.GetKind())
			g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
			for _, w := range tc.want {
				g.Expect(err.Error()).To(ContainSubstring(w))
			}
			// Nothing was stored.
			got := &unstructured.Unstructured{}
			got.SetGroupVersionKind(tc.obj.GroupVersionKind())
			g.Expect(apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(tc.obj), got))).To(BeTrue())
		})
	}
}

// TestUpdateRules checks the rules that compare a spec with its previous
// version: what may not shrink or change after creation.
func TestUpdateRules(t *testing.T) {
	newVol := func(g Gomega, spec v1.VolumeSpec) *v1.Volume {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name("upd"), Namespace: ns}, Spec: spec}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
		return v
	}
	expectRejected := func(g Gomega, obj client.Object, want string) {
		before := obj.DeepCopyObject().(client.Object)
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(obj), before)).To(Succeed())
		err := k8sClient.Update(ctx, obj)
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
		g.Expect(err.Error()).To(ContainSubstring(want))
		after := obj.DeepCopyObject().(client.Object)
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(obj), after)).To(Succeed())
		g.Expect(after.GetResourceVersion()).To(Equal(before.GetResourceVersion()), "a rejected update changed the object")
	}

	t.Run("volume grows", func(t *testing.T) {
		g := NewWithT(t)
		v := newVol(g, v1.VolumeSpec{Size: q("1Gi")})
		v.Spec.Size = q("2Gi")
		g.Expect(k8sClient.Update(ctx, v)).To(Succeed())
	})
	t.Run("volume cannot shrink", func(t *testing.T) {
		g := NewWithT(t)
		v := newVol(g, v1.VolumeSpec{Size: q("2Gi")})
		v.Spec.Size = q("1Gi")
		expectRejected(g, v, "size cannot shrink")
	})
	t.Run("data source cannot be added", func(t *testing.T) {
		g := NewWithT(t)
		v := newVol(g, v1.VolumeSpec{Size: q("1Gi")})
		v.Spec.DataSource = &v1.VolumeDataSource{Volume: "other"}
		expectRejected(g, v, "dataSource can only be set when the volume is created")
	})
	t.Run("data source cannot change", func(t *testing.T) {
		g := NewWithT(t)
		v := newVol(g, v1.VolumeSpec{Size: q("1Gi"), DataSource: &v1.VolumeDataSource{Volume: "a"}})
		v.Spec.DataSource.Volume = "b"
		expectRejected(g, v, "dataSource is immutable")
	})
	t.Run("replica data directory is fixed once set", func(t *testing.T) {
		g := NewWithT(t)
		r := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: name("upd"), Namespace: ns},
			Spec: v1.ReplicaSpec{VolumeName: "v", Size: q("1Gi")}}
		g.Expect(k8sClient.Create(ctx, r)).To(Succeed())
		r.Spec.DataDirectoryName = "v-1"
		g.Expect(k8sClient.Update(ctx, r)).To(Succeed(), "setting it the first time is allowed")
		r.Spec.DataDirectoryName = "v-2"
		expectRejected(g, r, "dataDirectoryName cannot change once set")
	})
	t.Run("storage node name is immutable", func(t *testing.T) {
		g := NewWithT(t)
		sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: name("upd"), Namespace: ns},
			Spec: v1.StorageNodeSpec{NodeName: "a"}}
		g.Expect(k8sClient.Create(ctx, sn)).To(Succeed())
		sn.Spec.NodeName = "b"
		expectRejected(g, sn, "nodeName is immutable")
	})
}

// TestPrinterColumns checks the columns `kubectl get` shows for each kind,
// both in the installed CRDs and in real kubectl output.
func TestPrinterColumns(t *testing.T) {
	want := map[string][]string{
		"volumes":          {"State", "Robustness", "Size", "Used", "Replicas", "Node", "Frontend", "Endpoint", "Age"},
		"engines":          {"State", "Volume", "Node", "Endpoint", "Size", "Age"},
		"replicas":         {"State", "Volume", "Node", "Disk", "Failed", "Address", "Age"},
		"instancemanagers": {"State", "Node", "Address", "Age"},
		"storagenodes":     {"Node", "Schedulable", "Ready", "Drainable", "Replicas", "Evicting", "Age"},
	}
	for plural, cols := range want {
		t.Run(plural, func(t *testing.T) {
			g := NewWithT(t)
			crd := &apiextensionsv1.CustomResourceDefinition{}
			g.Expect(k8sClient.Get(ctx, client.ObjectKey{Name: plural + ".storage.cairn.io"}, crd)).To(Succeed())
			g.Expect(crd.Spec.Versions).To(HaveLen(1))
			var got []string
			for _, c := range crd.Spec.Versions[0].AdditionalPrinterColumns {
				got = append(got, c.Name)
			}
			g.Expect(got).To(Equal(cols))
			g.Expect(crd.Spec.Names.Categories).To(ContainElement("cairn"))
		})
	}

	t.Run("kubectl get volumes", func(t *testing.T) {
		g := NewWithT(t)
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name("printed"), Namespace: ns},
			Spec: v1.VolumeSpec{Size: q("5Gi"), NumberOfReplicas: 2}}
		g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
		v.Status = v1.VolumeStatus{State: v1.VolumeStateAttached, Robustness: v1.VolumeRobustnessHealthy, CurrentNodeName: "worker-9"}
		g.Expect(k8sClient.Status().Update(ctx, v)).To(Succeed())
		out := kubectl(g, "get", "cvol", v.Name, "-n", ns)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		g.Expect(lines).To(HaveLen(2), out)
		g.Expect(strings.Fields(lines[0])).To(Equal([]string{"NAME", "STATE", "ROBUSTNESS", "SIZE", "REPLICAS", "NODE", "AGE"}))
		g.Expect(strings.Fields(lines[1])[:6]).To(Equal([]string{v.Name, "attached", "healthy", "5Gi", "2", "worker-9"}))
	})
}

// TestSamplesServerDryRun applies config/samples with kubectl's server-side
// dry run: the API server validates every sample and stores nothing.
func TestSamplesServerDryRun(t *testing.T) {
	g := NewWithT(t)
	out := kubectl(g, "apply", "--dry-run=server", "-n", ns, "-k", "../config/samples")
	for _, kind := range []string{"volume", "engine", "replica", "instancemanager", "storagenode", "recurringjob"} {
		g.Expect(out).To(MatchRegexp(`(?m)^%s\.storage\.cairn\.io/\S+ created \(server dry run\)$`, kind))
	}
	vol := &v1.Volume{}
	err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: "sample-volume"}, vol)
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "a dry run stored the sample volume")
}

// kubectl runs envtest's kubectl against the test API server as an admin
// (system:masters) user and returns its stdout, failing the test with
// stderr when it exits non-zero.
func kubectl(g Gomega, args ...string) string {
	user, err := testEnv.AddUser(envtest.User{Name: "schema-test", Groups: []string{"system:masters"}}, nil)
	g.Expect(err).NotTo(HaveOccurred(), "provisioning the kubectl user")
	kc, err := user.Kubectl()
	g.Expect(err).NotTo(HaveOccurred(), "writing the kubectl user's kubeconfig")
	stdout, stderr, err := kc.Run(args...)
	outb, _ := io.ReadAll(stdout)
	errb, _ := io.ReadAll(stderr)
	g.Expect(err).NotTo(HaveOccurred(), "kubectl %s: %s", strings.Join(args, " "), errb)
	return string(outb)
}

// refusedOn checks that the API server refused err's object with exactly
// one cause on field, whose message ends in want: the user reads the rule
// that names the real cause, and no other rule's message beside it.
func refusedOn(g Gomega, err error, field, want string) {
	g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
	var causes []string
	for _, c := range statusCauses(err) {
		if c.Field == field {
			causes = append(causes, c.Message)
		}
	}
	g.Expect(causes).To(HaveLen(1), "want one cause on %s, got %v", field, err)
	g.Expect(causes[0]).To(HaveSuffix(": "+want), "on %s", field)
}

// statusCauses are the causes an API error gives, one per field and rule.
func statusCauses(err error) []metav1.StatusCause {
	var st apierrors.APIStatus
	if !errors.As(err, &st) || st.Status().Details == nil {
		return nil
	}
	return st.Status().Details.Causes
}

// Messages of the size rules, as a user reads them.
const (
	sizeTooSmall  = "size must be at least 1Mi (1048576 bytes)"
	sizeTooLarge  = "size must be at most 64Ti (70368744177664 bytes), the largest volume Cairn serves"
	sizeNotBlocks = "size must be a whole number of bytes divisible by 4096, such as 10Gi or 1073741824"
)

// TestVolumeSizeRules: the API server judges a Volume's spec.size by its
// value, whatever form it is written in (binary and decimal suffixes,
// fractions, exponents, a plain number, a JSON number), from 1Mi to
// MaxVolumeSize in whole 4096-byte blocks; a refusal carries the one rule
// that names the real cause, and nothing is stored. Quantities such as
// 100Ti, 1Pi and 1.5Ti are held as arbitrary-precision decimals, which
// CEL's isInteger()/asInteger() do not convert: the rules compare
// quantities instead.
func TestVolumeSizeRules(t *testing.T) {
	largest := strconv.FormatInt(v1.MaxVolumeSize, 10)
	cases := []struct {
		size any // as written in YAML: a string, or a JSON number
		want string
	}{
		// The smallest and the largest, in several forms.
		{"1Mi", ""},
		{int64(v1.MinVolumeSize), ""},
		{"64Ti", ""},
		{largest, ""},
		{int64(v1.MaxVolumeSize), ""},
		{"0.0625Pi", ""},
		{"65536Gi", ""},
		{strconv.FormatInt(v1.MaxVolumeSize-v1.BlockSize, 10), ""},
		// Binary suffixes, fractions of them, decimal suffixes, exponents.
		{"4Ki", sizeTooSmall},
		{"10Gi", ""},
		{"1.5Ti", ""},
		{"0.5Ti", ""},
		{"62.5Ti", ""},
		{"10.25Gi", ""},
		{"1.5Mi", ""},
		{"+1Gi", ""},
		{"4096k", ""},
		{"8T", ""},
		{"5e12", ""},
		{"4.194304e6", ""},
		{"1048576e0", ""},
		// Above the largest: one message, whatever the form.
		{"100Ti", sizeTooLarge},
		{"109951162777600", sizeTooLarge},
		{int64(109951162777600), sizeTooLarge},
		{"1Pi", sizeTooLarge},
		{"2Pi", sizeTooLarge},
		{"1Ei", sizeTooLarge},
		{"64.00000001Ti", sizeTooLarge},
		{strconv.FormatInt(v1.MaxVolumeSize+v1.BlockSize, 10), sizeTooLarge},
		{"9223372036854775807", sizeTooLarge},
		{"9223372036854775808", sizeTooLarge},
		{"1e30", sizeTooLarge},
		// Below the smallest.
		{strconv.FormatInt(v1.MinVolumeSize-v1.BlockSize, 10), sizeTooSmall},
		{"1e3", sizeTooSmall},
		{"0", sizeTooSmall},
		{"1m", sizeTooSmall},
		{"-1Gi", sizeTooSmall},
		{"-1e30", sizeTooSmall},
		// Not whole blocks.
		{int64(v1.MinVolumeSize + 1), sizeNotBlocks},
		{"1G", sizeNotBlocks},
		{"1.1Mi", sizeNotBlocks},
		{"1.0000001Gi", sizeNotBlocks},
		{"1048576.5", sizeNotBlocks},
		{"0.001Pi", sizeNotBlocks},
		{"63.9999999Ti", sizeNotBlocks},
		{strconv.FormatInt(v1.MaxVolumeSize-1, 10), sizeNotBlocks},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.size), func(t *testing.T) {
			g := NewWithT(t)
			obj := u("Volume", map[string]any{"size": tc.size})
			err := k8sClient.Create(ctx, obj)
			got := &v1.Volume{}
			getErr := k8sClient.Get(ctx, client.ObjectKeyFromObject(obj), got)
			if tc.want == "" {
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(getErr).NotTo(HaveOccurred())
				g.Expect(got.Spec.Size.Cmp(resource.MustParse(fmt.Sprint(tc.size)))).To(BeZero(), "stored %s", got.Spec.Size.String())
				return
			}
			refusedOn(g, err, "spec.size", tc.want)
			g.Expect(apierrors.IsNotFound(getErr)).To(BeTrue(), "a refused Volume was stored")
		})
	}
	t.Run("not a quantity", func(t *testing.T) {
		g := NewWithT(t)
		err := k8sClient.Create(ctx, u("Volume", map[string]any{"size": "ten"}))
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
		g.Expect(statusCauses(err)).To(ContainElement(
			HaveField("Field", "spec.size")))
	})
}

// TestVolumeSizeUpdates: a Volume grows to any size the rules allow,
// written in any form, and the refusal of a larger or smaller size names
// that cause alone.
func TestVolumeSizeUpdates(t *testing.T) {
	steps := []struct {
		from, to string
		want     string
	}{
		{"1Gi", "1.5Ti", ""},
		{"1.5Ti", "1536Gi", ""}, // the same size written otherwise
		{"1.5Ti", "64Ti", ""},
		{"64Ti", "100Ti", sizeTooLarge},
		{"1Gi", "1Pi", sizeTooLarge},
		{"1.5Ti", "1Ti", "size cannot shrink; create a new volume and copy the data instead"},
	}
	for _, s := range steps {
		t.Run(s.from+"->"+s.to, func(t *testing.T) {
			g := NewWithT(t)
			v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name("grow"), Namespace: ns}, Spec: v1.VolumeSpec{Size: q(s.from)}}
			g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
			before := v.ResourceVersion
			v.Spec.Size = q(s.to)
			err := k8sClient.Update(ctx, v)
			if s.want == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			refusedOn(g, err, "spec.size", s.want)
			got := &v1.Volume{}
			g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(v), got)).To(Succeed())
			g.Expect(got.ResourceVersion).To(Equal(before), "a refused update changed the Volume")
			g.Expect(got.Spec.Size.Cmp(q(s.from))).To(BeZero())
		})
	}
}

// TestEngineAndReplicaSizeRules: an Engine's and a Replica's size follow
// the same whole-block rule up to MaxVolumeSize, in any form.
func TestEngineAndReplicaSizeRules(t *testing.T) {
	const (
		engineRange  = "size must be from 0 to 64Ti (70368744177664 bytes)"
		replicaRange = "size must be more than 0 and at most 64Ti (70368744177664 bytes)"
		blocks       = "size must be a whole number of bytes divisible by 4096"
	)
	cases := []struct {
		kind string
		size any
		want string
	}{
		{"Engine", "0", ""},
		{"Engine", "1.5Ti", ""},
		{"Engine", "64Ti", ""},
		{"Engine", "100Ti", engineRange},
		{"Engine", "-4Ki", engineRange},
		{"Engine", int64(4097), blocks},
		{"Engine", "1.1Mi", blocks},
		{"Replica", "4Ki", ""},
		{"Replica", "1.5Ti", ""},
		{"Replica", "64Ti", ""},
		{"Replica", "1Pi", replicaRange},
		{"Replica", "0", replicaRange},
		{"Replica", "-4Ki", replicaRange},
		{"Replica", "0.001Pi", blocks},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%s %v", tc.kind, tc.size), func(t *testing.T) {
			g := NewWithT(t)
			err := k8sClient.Create(ctx, u(tc.kind, map[string]any{"volumeName": "v", "size": tc.size}))
			if tc.want == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			refusedOn(g, err, "spec.size", tc.want)
		})
	}
}
