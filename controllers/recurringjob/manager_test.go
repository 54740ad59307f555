package recurringjob

import (
	"context"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/snapshot"
)

// lockedClock is a clock the manager's workers read while the test
// moves it.
type lockedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *lockedClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *lockedClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// TestManagerRunsJob runs the RecurringJob and Snapshot reconcilers in a
// manager, as cairn-manager does (SetupWithManager and its watches): a
// job due at creation snapshots its volumes with nothing else driving
// it and counts them done; at the next scheduled time (noticed when a
// Volume changes) it snapshots again and prunes the older ones to
// retain 1, on the objects and on the engines.
func TestManagerRunsJob(t *testing.T) {
	r := newRig(t)
	clk := &lockedClock{}
	managed = func(mgr ctrl.Manager) error {
		if err := (&snapshot.Reconciler{Client: mgr.GetClient()}).SetupWithManager(mgr); err != nil {
			return err
		}
		return (&Reconciler{Client: mgr.GetClient(), Now: clk.now}).SetupWithManager(mgr)
	}
	restart := func() {
		env.StopManager()
		r.g.Expect(env.StartManager()).To(Succeed())
	}
	restart()
	t.Cleanup(func() { managed = nil; restart() })

	labels := map[string]string{"rj-test": "mg"}
	ea, eb := r.volume("mg-a", labels, true), r.volume("mg-b", labels, true)
	hourly, err := parseSchedule("0 * * * *")
	r.g.Expect(err).NotTo(HaveOccurred())
	// The job is created at the wall clock's time; its clock is already
	// past its first scheduled time.
	first := hourly.Next(time.Now().UTC())
	clk.set(first.Add(2 * time.Minute))
	r.job("mg", func(j *v1.RecurringJob) {
		j.Spec.Retain = 1
		j.Spec.Selector = &metav1.LabelSelector{MatchLabels: labels}
	})
	// A job created just before the hour has its first run at that hour;
	// one created just after it, the next.
	j := r.getJob("mg")
	run1 := hourly.Next(j.CreationTimestamp.UTC())
	if run1.After(clk.now()) {
		clk.set(run1.Add(2 * time.Minute))
		r.touchVolume("mg-a")
	}
	r.g.Eventually(func(g Gomega) {
		j := r.getJob("mg")
		g.Expect(j.Status.LastRunTime).NotTo(BeNil())
		g.Expect(j.Status.LastRunTime.Time).To(BeTemporally("==", run1))
		g.Expect(j.Status.LastResult.Succeeded).To(BeEquivalentTo(2), j.Status.LastResult.Message)
	}).WithTimeout(timeout).WithPolling(100 * time.Millisecond).Should(Succeed())

	run2 := run1.Add(time.Hour)
	clk.set(run2.Add(time.Minute))
	r.touchVolume("mg-b") // a Volume's change brings the job back
	want := func(vol string) []string { return []string{objectName("mg", vol, run2)} }
	r.g.Eventually(func(g Gomega) {
		j := r.getJob("mg")
		g.Expect(j.Status.LastRunTime.Time).To(BeTemporally("==", run2))
		g.Expect(j.Status.NextRunTime.Time).To(BeTemporally("==", run2.Add(time.Hour)))
		g.Expect(names(r.snapshotsOf("mg", "mg-a"))).To(Equal(want("mg-a")))
		g.Expect(names(r.snapshotsOf("mg", "mg-b"))).To(Equal(want("mg-b")))
		g.Expect(engineSnapshots(t, ea)).To(Equal(want("mg-a")))
		g.Expect(engineSnapshots(t, eb)).To(Equal(want("mg-b")))
	}).WithTimeout(timeout).WithPolling(100 * time.Millisecond).Should(Succeed())
}

// touchVolume changes a label of the volume, as a user or the CSI
// driver might.
func (r *rig) touchVolume(name string) {
	r.t.Helper()
	v := &v1.Volume{}
	r.g.Expect(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: name}, v)).To(Succeed())
	v.Labels["rj-touched"] = time.Now().Format("150405.000000")
	r.g.Expect(k8sClient.Update(context.Background(), v)).To(Succeed())
}
