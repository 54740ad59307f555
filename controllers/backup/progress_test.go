package backup

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// countingClient counts status patches.
type countingClient struct {
	client.Client
	patches atomic.Int32
}

func (c *countingClient) Status() client.SubResourceWriter {
	return countingStatus{c.Client.Status(), c}
}

type countingStatus struct {
	client.SubResourceWriter
	c *countingClient
}

func (s countingStatus) Patch(ctx context.Context, o client.Object, p client.Patch, opts ...client.SubResourcePatchOption) error {
	s.c.patches.Add(1)
	return s.SubResourceWriter.Patch(ctx, o, p, opts...)
}

// TestProgressPatches: an upload's progress reaches the Backup's status
// while it runs, at most once per ProgressInterval however often the store
// reports, and with the latest numbers.
func TestProgressPatches(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	b := &v1.Backup{ObjectMeta: metav1.ObjectMeta{Name: "progress", Namespace: ns}, Spec: v1.BackupSpec{Volume: "v", Target: "t"}}
	g.Expect(k8sClient.Create(ctx, b)).To(Succeed())
	b.Status.State = v1.BackupStateInProgress
	g.Expect(k8sClient.Status().Update(ctx, b)).To(Succeed())

	cc := &countingClient{Client: k8sClient}
	const interval = 300 * time.Millisecond
	r := &Reconciler{Client: cc, ProgressInterval: interval, StallTimeout: time.Hour}
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	w := r.watch(wctx, cancel, &job{key: keyOf(b)}, "parent-1")
	// A store reporting every 5 ms for 1.5 s (the sleep paces the
	// reports; nothing waits on it).
	const total = 300 << 20
	start := time.Now()
	var done int64
	for time.Since(start) < 1500*time.Millisecond {
		done = min(done+1<<20, total)
		w.progress(done, total)
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	// The last numbers are patched within an interval or two.
	g.Eventually(func() int64 {
		got := &v1.Backup{}
		g.Expect(k8sClient.Get(ctx, keyOf(b), got)).To(Succeed())
		return got.Status.BytesDone
	}, 10*interval+timeout/10, 20*time.Millisecond).Should(Equal(done))
	w.stop()
	got := &v1.Backup{}
	g.Expect(k8sClient.Get(ctx, keyOf(b), got)).To(Succeed())
	g.Expect(got.Status.BytesTotal).To(Equal(int64(total)))
	g.Expect(got.Status.Progress).To(Equal(percent(done, total)))
	g.Expect(got.Status.Parent).To(Equal("parent-1"))
	n := cc.patches.Load()
	g.Expect(n).To(BeNumerically(">=", 2), "progress is patched while the upload runs")
	g.Expect(n).To(BeNumerically("<=", int32(time.Since(start)/interval)+1), "at most one patch per interval (%v of reports)", elapsed)
	g.Expect(context.Cause(wctx)).To(BeNil(), "not taken for a stall")
}
