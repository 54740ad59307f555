package recurringjob

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/controllers/snapshot"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/engineserver"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/replica"
	"github.com/cairn-io/cairn/dataplane/replica/replicaserver"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

const (
	ns   = "default"
	size = 16 << 20
)

var timeout = deadline.Scale(60 * time.Second)

func newSnapshotObj(name string) *v1.Snapshot {
	return &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
}

// startEngine runs an engine over two replicas in process, its control
// API on loopback, as `cairn-data engine` serves it.
func startEngine(t *testing.T, name string) (*engine.Engine, string) {
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
	e, err := engine.Open(ctx, engine.Options{Name: name, Replicas: addrs,
		Dial: replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{Conns: 1}})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	gs := grpc.NewServer()
	enginev1.RegisterEngineServiceServer(gs, &engineserver.Server{E: e, Name: name})
	l := listen()
	// Serve returns nil once Stop runs at cleanup; a failure before then
	// shows as the snapshot calls failing in the test itself.
	go func() { _ = gs.Serve(l) }()
	t.Cleanup(gs.Stop)
	return e, l.Addr().String()
}

// clock is the reconciler's time, moved by the test.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

type rig struct {
	t     *testing.T
	g     *WithT
	clock *clock
	r     *Reconciler
	snaps *snapshot.Reconciler
}

func newRig(t *testing.T) *rig {
	c := &clock{}
	return &rig{t: t, g: NewWithT(t), clock: c, r: &Reconciler{Client: k8sClient, Now: c.now}, snaps: &snapshot.Reconciler{Client: k8sClient}}
}

func (r *rig) reconcile(name string) (ctrl.Result, error) {
	r.t.Helper()
	return r.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: name}})
}

// volume creates a Volume with labels; with an engine, also its Engine
// object with the status its reconciler reports for a running engine.
func (r *rig) volume(name string, labels map[string]string, withEngine bool) *engine.Engine {
	r.t.Helper()
	ctx := context.Background()
	v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec: v1.VolumeSpec{Size: resource.MustParse("16Mi"), NumberOfReplicas: 2}}
	r.g.Expect(k8sClient.Create(ctx, v)).To(Succeed())
	if !withEngine {
		return nil
	}
	eng, addr := startEngine(r.t, name)
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: volumes.EngineName(v), Namespace: ns},
		Spec: v1.EngineSpec{VolumeName: v.Name, NodeName: "n1", Size: v.Spec.Size, DesiredState: v1.DesiredInstanceStateRunning}}
	r.g.Expect(k8sClient.Create(ctx, e)).To(Succeed())
	e.Status.InstanceState, e.Status.Address = v1.InstanceStateRunning, addr
	e.Status.ReplicaModeMap = map[string]v1.ReplicaMode{name + "-r1": v1.ReplicaModeRW, name + "-r2": v1.ReplicaModeRW}
	r.g.Expect(k8sClient.Status().Update(ctx, e)).To(Succeed())
	return eng
}

func (r *rig) job(name string, mutate func(*v1.RecurringJob)) *v1.RecurringJob {
	r.t.Helper()
	j := &v1.RecurringJob{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.RecurringJobSpec{Schedule: "0 * * * *", Task: v1.RecurringJobTaskSnapshot, Retain: 2}}
	if mutate != nil {
		mutate(j)
	}
	r.g.Expect(k8sClient.Create(context.Background(), j)).To(Succeed())
	return r.getJob(name)
}

func (r *rig) getJob(name string) *v1.RecurringJob {
	r.t.Helper()
	j := &v1.RecurringJob{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, j)).To(Succeed())
	return j
}

// firstRun is the job's first scheduled time after its creation.
func (r *rig) firstRun(j *v1.RecurringJob) time.Time {
	sch, err := parseSchedule(j.Spec.Schedule)
	r.g.Expect(err).NotTo(HaveOccurred())
	return sch.Next(j.CreationTimestamp.UTC())
}

// snapshotsOf lists the Snapshots job made of volume, by name, with
// whether each is being deleted.
func (r *rig) snapshotsOf(job, volume string) []v1.Snapshot {
	r.t.Helper()
	var ss v1.SnapshotList
	r.g.Expect(k8sClient.List(context.Background(), &ss, client.InNamespace(ns),
		client.MatchingLabels{v1.LabelRecurringJob: job, volumes.LabelVolume: volume})).To(Succeed())
	slices.SortFunc(ss.Items, func(a, b v1.Snapshot) int { return cmpStr(a.Name, b.Name) })
	return ss.Items
}

func cmpStr(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// settleSnapshots runs the Snapshot reconciler over the job's
// Snapshots of the volumes until none is unfinished: taken on the
// engine, or deleted from it and gone.
func (r *rig) settleSnapshots(job string, vols ...string) {
	r.t.Helper()
	ctx := context.Background()
	r.g.Eventually(func(g Gomega) {
		for _, vol := range vols {
			for _, s := range r.snapshotsOf(job, vol) {
				_, err := r.snaps.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(&s)})
				g.Expect(err).NotTo(HaveOccurred())
			}
			for _, s := range r.snapshotsOf(job, vol) {
				g.Expect(s.DeletionTimestamp).To(BeNil(), s.Name)
				g.Expect(s.Status.ReadyToUse).To(BeTrue(), s.Name)
			}
		}
	}).WithTimeout(timeout).WithPolling(100 * time.Millisecond).Should(Succeed())
}

func names(ss []v1.Snapshot) []string {
	var out []string
	for _, s := range ss {
		out = append(out, s.Name)
	}
	return out
}

func engineSnapshots(t *testing.T, e *engine.Engine) []string {
	t.Helper()
	snaps, err := e.Snapshots(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range snaps {
		if s.UserCreated {
			out = append(out, s.Name)
		}
	}
	slices.Sort(out)
	return out
}

func ready(j *v1.RecurringJob) *metav1.Condition {
	return meta.FindStatusCondition(j.Status.Conditions, v1.RecurringJobConditionReady)
}

// TestRetainSnapshots: an hourly snapshot job with retain 2 over a group,
// run at four successive scheduled times, leaves the two newest
// Snapshots of each volume in the group, on the object and on the
// engine's replicas, and none of a volume outside it; its status names
// each run and the next one.
func TestRetainSnapshots(t *testing.T) {
	r := newRig(t)
	grp := map[string]string{v1.RecurringJobGroupLabel("hourly"): v1.RecurringJobGroupEnabled}
	engines := map[string]*engine.Engine{"rs-a": r.volume("rs-a", grp, true), "rs-b": r.volume("rs-b", grp, true)}
	r.volume("rs-c", map[string]string{v1.RecurringJobGroupLabel("hourly"): "disabled"}, false)
	j := r.job("rs", func(j *v1.RecurringJob) { j.Spec.Groups = []string{"hourly"} })
	t0 := r.firstRun(j)

	r.clock.t = t0.Add(-time.Second)
	res, err := r.reconcile("rs")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(res.RequeueAfter).To(Equal(time.Second), "waits for the first scheduled time")
	j = r.getJob("rs")
	r.g.Expect(j.Status.LastRunTime).To(BeNil())
	r.g.Expect(j.Status.NextRunTime.Time).To(BeTemporally("==", t0))
	r.g.Expect(ready(j).Reason).To(Equal(v1.RecurringJobReasonScheduled))
	r.g.Expect(r.snapshotsOf("rs", "rs-a")).To(BeEmpty())

	var runs []time.Time
	for k := range 4 {
		run := t0.Add(time.Duration(k) * time.Hour)
		runs = append(runs, run)
		r.clock.t = run.Add(90 * time.Second)
		_, err := r.reconcile("rs")
		r.g.Expect(err).NotTo(HaveOccurred())
		j = r.getJob("rs")
		r.g.Expect(j.Status.LastRunTime.Time).To(BeTemporally("==", run), "run %d", k)
		r.g.Expect(j.Status.NextRunTime.Time).To(BeTemporally("==", run.Add(time.Hour)), "run %d", k)
		r.g.Expect(j.Status.LastResult.Volumes).To(BeEquivalentTo(2))
		r.g.Expect(j.Status.LastResult.Succeeded).To(BeEquivalentTo(0), "just created")
		r.settleSnapshots("rs", "rs-a", "rs-b")
		// The run's Snapshots done: counted, and the oldest pruned.
		_, err = r.reconcile("rs")
		r.g.Expect(err).NotTo(HaveOccurred())
		r.g.Expect(r.getJob("rs").Status.LastResult.Succeeded).To(BeEquivalentTo(2), "run %d", k)
		r.settleSnapshots("rs", "rs-a", "rs-b")
	}
	for _, vol := range []string{"rs-a", "rs-b"} {
		want := []string{objectName("rs", vol, runs[2]), objectName("rs", vol, runs[3])}
		r.g.Expect(names(r.snapshotsOf("rs", vol))).To(Equal(want), vol)
		r.g.Expect(engineSnapshots(t, engines[vol])).To(Equal(want), "on %s's replicas", vol)
	}
	r.g.Expect(r.snapshotsOf("rs", "rs-c")).To(BeEmpty())
	j = r.getJob("rs")
	r.g.Expect(j.Status.LastResult.Message).To(Equal("2 of 2 volumes done"))
	r.g.Expect(j.Status.ObservedGeneration).To(Equal(j.Generation))
}

// TestRetainOnEngine: what retention deletes goes from the replicas too
// (the Snapshot reconciler deletes it), and a Snapshot still being taken
// is neither counted nor deleted.
func TestRetainOnEngine(t *testing.T) {
	r := newRig(t)
	e := r.volume("re-a", map[string]string{"rj-test": "re"}, true)
	j := r.job("re", func(j *v1.RecurringJob) {
		j.Spec.Retain = 1
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"rj-test": "re"}}
	})
	t0 := r.firstRun(j)
	r.clock.t = t0
	_, err := r.reconcile("re")
	r.g.Expect(err).NotTo(HaveOccurred())
	first := objectName("re", "re-a", t0)
	// Not taken yet: a second run does not prune it (only completed
	// ones count).
	r.clock.t = t0.Add(time.Hour)
	_, err = r.reconcile("re")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(names(r.snapshotsOf("re", "re-a"))).To(Equal([]string{first, objectName("re", "re-a", t0.Add(time.Hour))}))
	r.settleSnapshots("re", "re-a")
	_, err = r.reconcile("re")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.settleSnapshots("re", "re-a")
	second := objectName("re", "re-a", t0.Add(time.Hour))
	r.g.Expect(names(r.snapshotsOf("re", "re-a"))).To(Equal([]string{second}))
	r.g.Expect(engineSnapshots(t, e)).To(Equal([]string{second}))
}

// TestMissedRunsAndRestart: a job that missed three scheduled times runs
// once, for the latest; a run repeated after a crash before its status
// was written (the objects exist, lastRunTime does not say so) creates
// nothing new.
func TestMissedRunsAndRestart(t *testing.T) {
	r := newRig(t)
	r.volume("mr-a", map[string]string{"rj-test": "mr"}, false)
	r.volume("mr-b", map[string]string{"rj-test": "mr"}, false)
	j := r.job("mr", func(j *v1.RecurringJob) {
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"rj-test": "mr"}}
	})
	t0 := r.firstRun(j)
	latest := t0.Add(3 * time.Hour)
	r.clock.t = latest.Add(40 * time.Minute)

	// The crash: the status write after the creates fails.
	crashing := &Reconciler{Client: failStatus{k8sClient}, Now: r.clock.now}
	_, err := crashing.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "mr"}})
	r.g.Expect(errors.Is(err, errStatus)).To(BeTrue(), "%v", err)
	r.g.Expect(r.getJob("mr").Status.LastRunTime).To(BeNil())
	want := func(vol string) []string { return []string{objectName("mr", vol, latest)} }
	r.g.Expect(names(r.snapshotsOf("mr", "mr-a"))).To(Equal(want("mr-a")))

	_, err = r.reconcile("mr")
	r.g.Expect(err).NotTo(HaveOccurred())
	j = r.getJob("mr")
	r.g.Expect(j.Status.LastRunTime.Time).To(BeTemporally("==", latest))
	r.g.Expect(j.Status.NextRunTime.Time).To(BeTemporally("==", latest.Add(time.Hour)))
	for _, vol := range []string{"mr-a", "mr-b"} {
		r.g.Expect(names(r.snapshotsOf("mr", vol))).To(Equal(want(vol)), vol)
	}
	// Reconciled again in the same period: nothing more.
	_, err = r.reconcile("mr")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(names(r.snapshotsOf("mr", "mr-b"))).To(Equal(want("mr-b")))
	r.g.Expect(r.getJob("mr").Status.LastResult.Message).To(ContainSubstring("2 in progress"))
}

var errStatus = errors.New("status write lost (test)")

// failStatus is a client whose status writes fail, as if the manager
// died before writing them.
type failStatus struct{ client.Client }

func (f failStatus) Status() client.SubResourceWriter { return failWriter{f.Client.Status()} }

type failWriter struct{ client.SubResourceWriter }

func (failWriter) Patch(context.Context, client.Object, client.Patch, ...client.SubResourcePatchOption) error {
	return errStatus
}

// TestBackupJob: a backup job whose target is missing says so and
// creates nothing; once the target exists, the scheduled time still in
// its period runs: a Backup of each selected volume to the target, at
// most concurrency unfinished at once.
func TestBackupJob(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	for _, v := range []string{"bj-a", "bj-b", "bj-c"} {
		r.volume(v, map[string]string{"rj-test": "bj"}, false)
	}
	j := r.job("bj", func(j *v1.RecurringJob) {
		j.Spec.Task, j.Spec.Target, j.Spec.Concurrency = v1.RecurringJobTaskBackup, "bj-target", 2
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"rj-test": "bj"}}
	})
	t0 := r.firstRun(j)
	r.clock.t = t0.Add(time.Minute)
	_, err := r.reconcile("bj")
	r.g.Expect(err).NotTo(HaveOccurred())
	j = r.getJob("bj")
	r.g.Expect(ready(j).Status).To(Equal(metav1.ConditionFalse))
	r.g.Expect(ready(j).Reason).To(Equal(v1.RecurringJobReasonTargetNotFound))
	r.g.Expect(j.Status.LastRunTime).To(BeNil())
	r.g.Expect(j.Status.NextRunTime.Time).To(BeTemporally("==", t0.Add(time.Hour)))
	backups := func() []v1.Backup {
		var bs v1.BackupList
		r.g.Expect(k8sClient.List(ctx, &bs, client.InNamespace(ns), client.MatchingLabels{v1.LabelRecurringJob: "bj"})).To(Succeed())
		slices.SortFunc(bs.Items, func(a, b v1.Backup) int { return cmpStr(a.Spec.Volume, b.Spec.Volume) })
		return bs.Items
	}
	r.g.Expect(backups()).To(BeEmpty())

	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: "bj-target"}, Spec: v1.BackupTargetSpec{S3: &v1.S3BackupTarget{
		Endpoint: "http://127.0.0.1:1", Bucket: "bucket", Region: "us-east-1", CredentialsSecret: v1.SecretReference{Name: "s", Namespace: ns}}}}
	r.g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	r.clock.t = t0.Add(30 * time.Minute)
	_, err = r.reconcile("bj")
	r.g.Expect(err).NotTo(HaveOccurred())
	j = r.getJob("bj")
	r.g.Expect(ready(j).Reason).To(Equal(v1.RecurringJobReasonScheduled))
	r.g.Expect(j.Status.LastRunTime.Time).To(BeTemporally("==", t0))
	bs := backups()
	r.g.Expect(bs).To(HaveLen(2), "concurrency 2")
	for _, b := range bs {
		r.g.Expect(b.Spec.Target).To(Equal("bj-target"))
		r.g.Expect(b.Name).To(Equal(objectName("bj", b.Spec.Volume, t0)))
	}
	r.g.Expect(j.Status.LastResult.Message).To(ContainSubstring("1 not started yet"))

	// One completes (its status as the Backup reconciler writes it): the
	// third volume's Backup starts.
	bs[0].Status.State = v1.BackupStateCompleted
	r.g.Expect(k8sClient.Status().Update(ctx, &bs[0])).To(Succeed())
	_, err = r.reconcile("bj")
	r.g.Expect(err).NotTo(HaveOccurred())
	r.g.Expect(backups()).To(HaveLen(3))
	j = r.getJob("bj")
	r.g.Expect(j.Status.LastResult.Succeeded).To(BeEquivalentTo(1))
	r.g.Expect(j.Status.LastResult.Volumes).To(BeEquivalentTo(3))
}

// TestBackupJobVolumeTargets: a backup job without spec.target backs
// each volume up to the volume's own spec.backupTarget, and names (does
// not count, does not wait for) the volumes that have none.
func TestBackupJobVolumeTargets(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	for _, v := range []string{"vt-a", "vt-b", "vt-none"} {
		r.volume(v, map[string]string{"rj-test": "vt"}, false)
	}
	for v, target := range map[string]string{"vt-a": "offsite", "vt-b": "nearby"} {
		vol := &v1.Volume{}
		r.g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: v}, vol)).To(Succeed())
		vol.Spec.BackupTarget = target
		r.g.Expect(k8sClient.Update(ctx, vol)).To(Succeed())
	}
	j := r.job("vt", func(j *v1.RecurringJob) {
		j.Spec.Task, j.Spec.Concurrency = v1.RecurringJobTaskBackup, 5
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"rj-test": "vt"}}
	})
	t0 := r.firstRun(j)
	r.clock.t = t0.Add(time.Minute)
	_, err := r.reconcile("vt")
	r.g.Expect(err).NotTo(HaveOccurred())
	j = r.getJob("vt")
	r.g.Expect(ready(j).Reason).To(Equal(v1.RecurringJobReasonScheduled), "no spec.target to wait for")
	var bs v1.BackupList
	r.g.Expect(k8sClient.List(ctx, &bs, client.InNamespace(ns), client.MatchingLabels{v1.LabelRecurringJob: "vt"})).To(Succeed())
	got := map[string]string{}
	for _, b := range bs.Items {
		got[b.Spec.Volume] = b.Spec.Target
	}
	r.g.Expect(got).To(Equal(map[string]string{"vt-a": "offsite", "vt-b": "nearby"}))
	r.g.Expect(j.Status.LastResult.Volumes).To(BeEquivalentTo(2))
	r.g.Expect(j.Status.LastResult.Message).To(ContainSubstring("1 skipped: no backup target"))
	r.g.Expect(j.Status.LastResult.Message).To(ContainSubstring("vt-none"))
}

// TestInvalidSpec: a schedule that does not parse is a condition saying
// why, with no next run; the API server refuses a retain out of range,
// another task, and a job that selects nothing.
func TestInvalidSpec(t *testing.T) {
	r := newRig(t)
	r.job("bad", func(j *v1.RecurringJob) {
		j.Spec.Schedule = "0 3 * *"
		j.Spec.Groups = []string{"x"}
	})
	r.clock.t = time.Now()
	_, err := r.reconcile("bad")
	r.g.Expect(err).NotTo(HaveOccurred())
	j := r.getJob("bad")
	r.g.Expect(ready(j).Reason).To(Equal(v1.RecurringJobReasonInvalidSchedule))
	r.g.Expect(ready(j).Message).To(ContainSubstring(`"0 3 * *"`))
	r.g.Expect(j.Status.NextRunTime).To(BeNil())

	for name, mutate := range map[string]func(*v1.RecurringJob){
		"retain-0":   func(j *v1.RecurringJob) { j.Spec.Retain = 0 },
		"retain-101": func(j *v1.RecurringJob) { j.Spec.Retain = 101 },
		"trim":       func(j *v1.RecurringJob) { j.Spec.Task = "trim" }, // the task is filesystem-trim
		"no-select":  func(j *v1.RecurringJob) { j.Spec.Groups = nil },
		"bad-group":  func(j *v1.RecurringJob) { j.Spec.Groups = []string{"Not_A_Label"} },
	} {
		j := &v1.RecurringJob{ObjectMeta: metav1.ObjectMeta{Name: "inv-" + name, Namespace: ns},
			Spec: v1.RecurringJobSpec{Schedule: "@daily", Task: v1.RecurringJobTaskSnapshot, Retain: 2, Groups: []string{"g"}}}
		mutate(j)
		err := k8sClient.Create(context.Background(), j)
		r.g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "%s: %v", name, err)
	}
}
