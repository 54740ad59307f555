package csi

import (
	"context"
	"crypto/rand"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// serveTrims runs d's trim loop with a watching client until t ends.
func serveTrims(t *testing.T, d *driver) {
	t.Helper()
	kc, err := cluster.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.RESTConfigFromKubeConfig(kc)
	if err != nil {
		t.Fatal(err)
	}
	w, err := client.NewWithWatch(cfg, client.Options{Scheme: cluster.Client.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.ServeTrims(ctx, w) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeTrims: %v", err)
		}
	})
}

// replicaAllocated is the disk space each replica of volume takes (the
// blocks of its files), by replica name.
func replicaAllocated(g Gomega, volume string) map[string]int64 {
	var reps v1.ReplicaList
	g.Expect(cluster.Client.List(context.Background(), &reps, client.InNamespace(testNamespace), client.MatchingLabels{labelVolume: volume})).To(Succeed())
	g.Expect(reps.Items).NotTo(BeEmpty())
	out := map[string]int64{}
	for _, r := range reps.Items {
		g.Expect(r.Spec.DataDirectoryName).NotTo(BeEmpty(), "replica %s is placed", r.Name)
		g.Expect(filepath.WalkDir(replica.DataDir(&r), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			var st unix.Stat_t
			if err := unix.Stat(path, &st); err != nil {
				return err
			}
			out[r.Name] += st.Blocks * 512
			return nil
		})).To(Succeed())
	}
	return out
}

// syncFS writes the dirty data and metadata of the filesystem at dir.
func syncFS(g Gomega, dir string) {
	f, err := os.Open(dir)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	g.Expect(unix.Syncfs(int(f.Fd()))).To(Succeed())
}

// TestFilesystemTrimJob runs a RecurringJob of task filesystem-trim with
// the whole control plane and a real node plugin: of three volumes in
// its group, an ext4 volume mounted on the node is trimmed there (the
// space of a file deleted from it, which the deletion alone left on the
// replicas, is freed on every replica, and the data kept reads back), a
// raw block volume attached to the same node is skipped by the node
// plugin and a detached one by the job, each named with its reason; the
// job's status counts them and the bytes the filesystem discarded.
func TestFilesystemTrimJob(t *testing.T) {
	needRoot(t)
	g := NewWithT(t)
	ctx := callCtx(t)
	addNodes(t, "trim-a", "trim-b")
	d := startDriver(t, "trim-a")
	serveTrims(t, d)

	const size = 256 << 20
	params := map[string]string{ParamNumberOfReplicas: "2", ParamFSType: "ext4", ParamRecurringJobGroups: "trimtest"}
	create := func(name string, vc *csipb.VolumeCapability) *csipb.Volume {
		res, err := d.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csipb.VolumeCapability{vc}, Parameters: params})
		g.Expect(err).NotTo(HaveOccurred())
		t.Cleanup(func() {
			_, _ = d.controller.DeleteVolume(context.Background(), &csipb.DeleteVolumeRequest{VolumeId: res.GetVolume().GetVolumeId()})
		})
		return res.GetVolume()
	}
	fsCap, blockCap := volCap("ext4", false), volCap("", true)
	fsVol, blockVol, detached := create("pvc-trim-fs", fsCap), create("pvc-trim-block", blockCap), create("pvc-trim-detached", fsCap)
	p := mountOn(t, g, d, d, fsVol, fsCap)
	b := mountOn(t, g, d, d, blockVol, blockCap)
	t.Cleanup(func() {
		unmountFrom(t, g, d, p, fsVol.GetVolumeId())
		unmountFrom(t, g, d, b, blockVol.GetVolumeId())
	})
	dev := d.mustDevice(t, g, fsVol.GetVolumeId())
	discardMax, err := os.ReadFile(fmt.Sprintf("/sys/block/%s/queue/discard_max_bytes", strings.TrimPrefix(dev, "/dev/")))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(strings.TrimSpace(string(discardMax))).NotTo(Equal("0"), "the loop device over the FUSE file takes discards")

	kept := writeData(t, g, p, "kept")
	const big = 64 << 20
	buf := make([]byte, big)
	rand.Read(buf)
	g.Expect(os.WriteFile(filepath.Join(p.target, "big"), buf, 0o600)).To(Succeed())
	syncFS(g, p.target)
	withBig := replicaAllocated(g, fsVol.GetVolumeId())
	g.Expect(os.Remove(filepath.Join(p.target, "big"))).To(Succeed())
	syncFS(g, p.target)
	deleted := replicaAllocated(g, fsVol.GetVolumeId())
	for r, n := range deleted {
		g.Expect(n).To(BeNumerically(">", withBig[r]-big/8), "deleting the file alone frees nothing on replica %s (the filesystem is not mounted with discard)", r)
	}

	job := &v1.RecurringJob{ObjectMeta: metav1.ObjectMeta{Name: "trim", Namespace: testNamespace},
		Spec: v1.RecurringJobSpec{Schedule: "* * * * *", Task: v1.RecurringJobTaskFilesystemTrim, Groups: []string{"trimtest"}, Concurrency: 2}}
	g.Expect(cluster.Client.Create(ctx, job)).To(Succeed())
	t.Cleanup(func() { _ = cluster.Client.Delete(context.Background(), job) })
	// The first run is at the first minute after the job's creation.
	var res *v1.RecurringJobRunResult
	g.Eventually(func(g Gomega) {
		j := &v1.RecurringJob{}
		g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(job), j)).To(Succeed())
		g.Expect(j.Status.LastResult).NotTo(BeNil(), "no run yet")
		res = j.Status.LastResult
		g.Expect(res.Succeeded+res.Skipped+res.Failed).To(BeEquivalentTo(3), res.Message)
	}, deadline.Scale(4*time.Minute), 200*time.Millisecond).Should(Succeed())
	t.Logf("run result: %d trimmed, %d skipped, %d failed, %d bytes: %s", res.Succeeded, res.Skipped, res.Failed, res.TrimmedBytes, res.Message)
	g.Expect(res.Volumes).To(BeEquivalentTo(3))
	g.Expect(res.Succeeded).To(BeEquivalentTo(1), res.Message)
	g.Expect(res.Skipped).To(BeEquivalentTo(2), res.Message)
	g.Expect(res.Failed).To(BeEquivalentTo(0), res.Message)
	g.Expect(res.TrimmedBytes).To(BeNumerically(">=", big), "the filesystem reports discarding at least the deleted file: %s", res.Message)
	g.Expect(res.Message).To(ContainSubstring("detached, no node has their filesystem mounted (" + detached.GetVolumeId() + ")"))
	g.Expect(res.Message).To(ContainSubstring(blockVol.GetVolumeId() + " on trim-a: a raw block volume"))

	v := &v1.Volume{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: fsVol.GetVolumeId()}, v)).To(Succeed())
	answer, err := v1.DecodeFilesystemTrimResult(v.Annotations[v1.FilesystemTrimResultAnnotation("trim")])
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(answer.Outcome).To(Equal(v1.FilesystemTrimTrimmed))
	g.Expect(answer.Node).To(Equal("trim-a"))
	g.Expect(answer.Run).To(Equal(v.Annotations[v1.FilesystemTrimRequestAnnotation("trim")]))

	trimmed := replicaAllocated(g, fsVol.GetVolumeId())
	t.Logf("replica space: with the file %v, deleted %v, trimmed %v", withBig, deleted, trimmed)
	g.Expect(trimmed).To(HaveLen(2))
	for r, n := range trimmed {
		g.Expect(n).To(BeNumerically("<", deleted[r]-big*7/8), "replica %s frees the deleted file's space: %d bytes before the trim, %d after", r, deleted[r], n)
	}
	g.Expect(readData(t, g, p, kept)).To(Succeed(), "what the filesystem holds reads back after the trim")
}

// TestPendingTrims: the node plugin answers only well-formed requests
// not answered for their run, at most MaxFilesystemTrimRequests of them.
func TestPendingTrims(t *testing.T) {
	g := NewWithT(t)
	run := "2026-11-27T18:00:00Z"
	answered := v1.FilesystemTrimResult{Run: run, Outcome: v1.FilesystemTrimTrimmed}.Encode()
	older := v1.FilesystemTrimResult{Run: "2026-11-27T17:00:00Z", Outcome: v1.FilesystemTrimTrimmed}.Encode()
	req, resKey := v1.FilesystemTrimRequestAnnotation, v1.FilesystemTrimResultAnnotation
	for name, tc := range map[string]struct {
		ann  map[string]string
		want map[string]string
	}{
		"new":               {ann: map[string]string{req("a"): run}, want: map[string]string{"a": run}},
		"answered":          {ann: map[string]string{req("a"): run, resKey("a"): answered}, want: map[string]string{}},
		"answered-earlier":  {ann: map[string]string{req("a"): run, resKey("a"): older}, want: map[string]string{"a": run}},
		"answer-unreadable": {ann: map[string]string{req("a"): run, resKey("a"): "{"}, want: map[string]string{"a": run}},
		"not-a-time":        {ann: map[string]string{req("a"): "soon"}, want: map[string]string{}},
		"too-long":          {ann: map[string]string{req("a"): run + strings.Repeat(" ", 64)}, want: map[string]string{}},
		"no-job":            {ann: map[string]string{v1.FilesystemTrimRequestAnnotationPrefix: run}, want: map[string]string{}},
		"other-annotations": {ann: map[string]string{"trim-request.example.com/a": run}, want: map[string]string{}},
	} {
		v := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Annotations: tc.ann}}
		g.Expect(pendingTrims(v)).To(Equal(tc.want), name)
	}
	many := map[string]string{}
	for i := range 40 {
		many[req(fmt.Sprintf("job-%02d", i))] = run
	}
	got := pendingTrims(&v1.Volume{ObjectMeta: metav1.ObjectMeta{Annotations: many}})
	g.Expect(got).To(HaveLen(v1.MaxFilesystemTrimRequests))
	g.Expect(got).To(HaveKey("job-00"))
	g.Expect(got).NotTo(HaveKey("job-39"))
}
