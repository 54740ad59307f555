package recurringjob

import (
	"context"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// setAttached writes the Volume's status as its reconciler reports it:
// attached to node, or detached when node is "".
func (r *rig) setAttached(name, node string) {
	r.t.Helper()
	v := r.getVolume(name)
	v.Status.State, v.Status.CurrentNodeName, v.Status.Endpoint = v1.VolumeStateDetached, "", ""
	if node != "" {
		v.Status.State, v.Status.CurrentNodeName, v.Status.Endpoint = v1.VolumeStateAttached, node, "/dev/loop-"+name
	}
	r.g.Expect(k8sClient.Status().Update(context.Background(), v)).To(Succeed())
}

func (r *rig) getVolume(name string) *v1.Volume {
	r.t.Helper()
	v := &v1.Volume{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, v)).To(Succeed())
	return v
}

// answerTrim writes a node plugin's answer to the volume's request.
func (r *rig) answerTrim(job, vol string, res v1.FilesystemTrimResult) {
	r.t.Helper()
	v := r.getVolume(vol)
	before := v.DeepCopy()
	res.Run = v.Annotations[v1.FilesystemTrimRequestAnnotation(job)]
	r.g.Expect(res.Run).NotTo(BeEmpty(), "volume %s was asked", vol)
	v.Annotations[v1.FilesystemTrimResultAnnotation(job)] = res.Encode()
	r.g.Expect(k8sClient.Patch(context.Background(), v, client.MergeFrom(before))).To(Succeed())
}

// trimRequests are the runs job ft asked the volumes to be trimmed for.
func (r *rig) trimRequests(vols ...string) map[string]string {
	r.t.Helper()
	out := map[string]string{}
	for _, vol := range vols {
		if run, ok := r.getVolume(vol).Annotations[v1.FilesystemTrimRequestAnnotation("ft")]; ok {
			out[vol] = run
		}
	}
	return out
}

// TestFilesystemTrimJob: a filesystem-trim run asks the attached volumes
// it selects to be trimmed, at most concurrency unanswered at once, and
// skips the detached ones (also one detached before its node answered);
// its result counts the node plugins' answers, sums the bytes trimmed
// and names the failures and the skipped volumes with their causes. A
// reconcile repeated in the same run asks nothing again; the next run
// asks again; a suspended job asks nothing.
func TestFilesystemTrimJob(t *testing.T) {
	r := newRig(t)
	vols := []string{"ft-a", "ft-b", "ft-c", "ft-d"}
	for _, v := range vols {
		r.volume(v, map[string]string{"rj-test": "ft"}, false)
	}
	r.setAttached("ft-a", "n1")
	r.setAttached("ft-b", "n2")
	r.setAttached("ft-d", "n1")
	j := r.job("ft", func(j *v1.RecurringJob) {
		j.Spec.Task, j.Spec.Retain, j.Spec.Concurrency = v1.RecurringJobTaskFilesystemTrim, 0, 2
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"rj-test": "ft"}}
	})
	t0 := r.firstRun(j)
	run0 := t0.Format(time.RFC3339)
	r.clock.t = t0.Add(time.Minute)
	reconcileOK := func() *v1.RecurringJobRunResult {
		t.Helper()
		_, err := r.reconcile("ft")
		r.g.Expect(err).NotTo(HaveOccurred())
		return r.getJob("ft").Status.LastResult
	}

	res := reconcileOK()
	r.g.Expect(r.trimRequests(vols...)).To(Equal(map[string]string{"ft-a": run0, "ft-b": run0}), "concurrency 2; ft-c is detached")
	r.g.Expect(res.Volumes).To(BeEquivalentTo(4))
	r.g.Expect(res.Skipped).To(BeEquivalentTo(1))
	r.g.Expect(res.Message).To(ContainSubstring("2 in progress, waiting for the CSI node plugin of their node (ft-a on n1, ft-b on n2)"))
	r.g.Expect(res.Message).To(ContainSubstring("1 not started yet"))
	r.g.Expect(res.Message).To(ContainSubstring("1 skipped: detached, no node has their filesystem mounted (ft-c)"))
	r.g.Expect(reconcileOK()).To(Equal(res), "repeated in the same run: nothing more is asked")
	r.g.Expect(r.trimRequests("ft-d")).To(BeEmpty())

	r.answerTrim("ft", "ft-a", v1.FilesystemTrimResult{Outcome: v1.FilesystemTrimTrimmed, Node: "n1", Bytes: 3 << 20})
	r.answerTrim("ft", "ft-b", v1.FilesystemTrimResult{Outcome: v1.FilesystemTrimFailed, Node: "n2", Message: "fstrim of /dev/loop-ft-b: input/output error"})
	res = reconcileOK()
	r.g.Expect(r.trimRequests("ft-d")).To(Equal(map[string]string{"ft-d": run0}), "the answers free two places")
	r.g.Expect(res.Succeeded).To(BeEquivalentTo(1))
	r.g.Expect(res.Failed).To(BeEquivalentTo(1))
	r.g.Expect(res.TrimmedBytes).To(BeEquivalentTo(3 << 20))
	r.g.Expect(res.Message).To(ContainSubstring("1 failed (ft-b on n2: fstrim of /dev/loop-ft-b: input/output error)"))

	// ft-d detaches before its node answers: nothing will answer it.
	r.setAttached("ft-d", "")
	res = reconcileOK()
	r.g.Expect(res.Succeeded).To(BeEquivalentTo(1))
	r.g.Expect(res.Failed).To(BeEquivalentTo(1))
	r.g.Expect(res.Skipped).To(BeEquivalentTo(2))
	r.g.Expect(res.Message).NotTo(ContainSubstring("in progress"))
	r.g.Expect(res.Message).To(ContainSubstring("(ft-c, ft-d)"))
	r.g.Expect(res.Message).To(HavePrefix("1 failed"))

	// The next run asks the attached volumes again, for itself; an
	// answer for the last run does not count in it.
	run1 := t0.Add(time.Hour)
	r.clock.t = run1.Add(time.Minute)
	res = reconcileOK()
	r.g.Expect(res.ScheduledTime.Time).To(BeTemporally("==", run1))
	r.g.Expect(r.trimRequests(vols...)).To(Equal(map[string]string{"ft-a": run1.Format(time.RFC3339), "ft-b": run1.Format(time.RFC3339), "ft-d": run0}))
	r.g.Expect(res.Succeeded + res.Failed).To(BeEquivalentTo(0))
	r.answerTrim("ft", "ft-a", v1.FilesystemTrimResult{Outcome: v1.FilesystemTrimSkipped, Node: "n1", Message: "a raw block volume: its device holds no filesystem"})
	res = reconcileOK()
	r.g.Expect(res.Message).To(ContainSubstring("1 skipped (ft-a on n1: a raw block volume: its device holds no filesystem)"))

	// Suspended: the run's unanswered request stays, no new one is made.
	j = r.getJob("ft")
	j.Spec.Suspend = true
	r.g.Expect(k8sClient.Update(context.Background(), j)).To(Succeed())
	r.clock.t = run1.Add(time.Hour + time.Minute)
	reconcileOK()
	r.g.Expect(r.trimRequests("ft-a", "ft-b")).To(Equal(map[string]string{"ft-a": run1.Format(time.RFC3339), "ft-b": run1.Format(time.RFC3339)}))
}

// TestTrimRunResultBounded: a run over many failing volumes keeps its
// message within the CRD's bound, giving the first causes in full.
func TestTrimRunResultBounded(t *testing.T) {
	g := NewWithT(t)
	var states []trimState
	for i := range 200 {
		states = append(states, trimState{volume: strings.Repeat("v", 60) + string(rune('a'+i%26)), phase: trimAnswered,
			result: v1.FilesystemTrimResult{Outcome: v1.FilesystemTrimFailed, Node: "n", Message: strings.Repeat("é", 300)}})
		states = append(states, trimState{volume: "d", phase: trimDetached})
	}
	res := trimRunResult(&v1.RecurringJob{}, time.Now(), states)
	g.Expect(len(res.Message)).To(BeNumerically("<=", maxMessage))
	g.Expect(res.Message).To(ContainSubstring("200 failed ("))
	g.Expect(res.Message).To(ContainSubstring("and 197 more"))
	g.Expect(strings.ToValidUTF8(res.Message, "?")).To(Equal(res.Message), "no character is cut in half")
	g.Expect(res.Failed).To(BeEquivalentTo(200))
	g.Expect(res.Skipped).To(BeEquivalentTo(200))
}

// TestFilesystemTrimSpec: the API server takes a filesystem-trim job
// without retain and refuses one with retain or a target, and a
// snapshot job without retain, each saying why.
func TestFilesystemTrimSpec(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	mk := func(name string, mutate func(*v1.RecurringJobSpec)) error {
		j := &v1.RecurringJob{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: v1.RecurringJobSpec{Schedule: "@daily", Task: v1.RecurringJobTaskFilesystemTrim, Groups: []string{"g"}}}
		mutate(&j.Spec)
		return k8sClient.Create(ctx, j)
	}
	g.Expect(mk("fts-ok", func(*v1.RecurringJobSpec) {})).To(Succeed())
	for name, tc := range map[string]struct {
		mutate func(*v1.RecurringJobSpec)
		says   string
	}{
		"fts-retain":        {func(s *v1.RecurringJobSpec) { s.Retain = 3 }, "spec.retain is not allowed for task filesystem-trim"},
		"fts-target":        {func(s *v1.RecurringJobSpec) { s.Target = "offsite" }, "spec.target is not allowed for task filesystem-trim"},
		"fts-snap-noretain": {func(s *v1.RecurringJobSpec) { s.Task = v1.RecurringJobTaskSnapshot }, "spec.retain is required for task snapshot and backup"},
	} {
		err := mk(name, tc.mutate)
		g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "%s: %v", name, err)
		g.Expect(err.Error()).To(ContainSubstring(tc.says), name)
		g.Expect(apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &v1.RecurringJob{}))).To(BeTrue(), "%s: nothing made", name)
	}
}
