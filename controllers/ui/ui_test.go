package ui

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/engine"
	"github.com/cairn-io/cairn/controllers/metrics"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
)

// put creates obj and, if status is given, writes the status it sets (as
// the object's reconciler would).
func put(g *WithT, obj client.Object, status func()) {
	ctx := context.Background()
	g.Expect(k8sClient.Create(ctx, obj)).To(Succeed())
	if status != nil {
		status()
		g.Expect(k8sClient.Status().Update(ctx, obj)).To(Succeed())
	}
}

func cond(conds *[]metav1.Condition, typ string, ok bool, reason, msg string) {
	st := metav1.ConditionFalse
	if ok {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(conds, metav1.Condition{Type: typ, Status: st, Reason: reason, Message: msg})
}

func qty(s string) *resource.Quantity { q := resource.MustParse(s); return &q }

// get fetches the page at path.
func get(g *WithT, h http.Handler, path string) (*http.Response, string) {
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Get(srv.URL + path)
	g.Expect(err).NotTo(HaveOccurred())
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	g.Expect(err).NotTo(HaveOccurred())
	return resp, string(b)
}

// section is the HTML of the page from open to the first end after it.
func section(page, open, end string) string {
	return regexp.MustCompile(`(?s)` + regexp.QuoteMeta(open) + `.*?` + regexp.QuoteMeta(end)).FindString(page)
}

// TestPage writes the objects of a volume being rebuilt, another without
// status, nodes, disks and events, and checks what the page shows of
// them: states and robustness with their badges, the message a person
// must read (escaped), RW counts, the disk bars, the rebuild's progress,
// replicas by node, and the events newest first.
func TestPage(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	const ns = "ui-page"
	g.Expect(k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	om := func(name string) metav1.ObjectMeta { return metav1.ObjectMeta{Name: name, Namespace: ns} }

	a := &v1.Volume{ObjectMeta: om("vol-a"), Spec: v1.VolumeSpec{Size: resource.MustParse("16Mi"), NumberOfReplicas: 2}}
	put(g, a, func() {
		a.Status.State, a.Status.Robustness, a.Status.CurrentNodeName, a.Status.ActualSize = v1.VolumeStateAttached, v1.VolumeRobustnessDegraded, "n1", qty("12Mi")
		cond(&a.Status.Conditions, v1.ConditionReady, true, v1.ReasonAsExpected, "attached to n1")
		cond(&a.Status.Conditions, v1.VolumeConditionRebuilding, false, v1.VolumeReasonNoRebuild, "not the message to show")
		cond(&a.Status.Conditions, v1.VolumeConditionScheduled, false, v1.VolumeReasonReplicaSchedulingFailed, "1 of 2 replicas placed: no disk has room")
	})
	b := &v1.Volume{ObjectMeta: om("vol-b"), Spec: v1.VolumeSpec{Size: resource.MustParse("1Gi"), NumberOfReplicas: 1}}
	put(g, b, func() {
		cond(&b.Status.Conditions, v1.ConditionReady, false, v1.ReasonReconciling, `<script>alert("x")</script> waits`)
	})
	e := &v1.Engine{ObjectMeta: om("vol-a-e"), Spec: v1.EngineSpec{VolumeName: "vol-a", Size: resource.MustParse("16Mi")}}
	put(g, e, func() {
		e.Status.ReplicaModeMap = map[string]v1.ReplicaMode{"vol-a-r1": v1.ReplicaModeRW, "vol-a-r2": v1.ReplicaModeWO}
		e.Status.RebuildStatus = map[string]v1.RebuildStatus{"vol-a-r2": {State: v1.RebuildStateInProgress, SourceReplica: "vol-a-r1",
			BytesDone: 1 << 20, BytesTotal: 4 << 20, DirtyOnly: true}}
	})
	for _, r := range []struct{ name, vol, node string }{{"vol-a-r1", "vol-a", "n1"}, {"vol-a-r2", "vol-a", "n2"}, {"vol-b-r1", "vol-b", ""}} {
		rep := &v1.Replica{ObjectMeta: om(r.name), Spec: v1.ReplicaSpec{VolumeName: r.vol, NodeName: r.node, Size: resource.MustParse("16Mi")}}
		put(g, rep, func() { rep.Status.InstanceState = v1.InstanceStateRunning })
	}
	sn := &v1.StorageNode{ObjectMeta: om("n1"), Spec: v1.StorageNodeSpec{NodeName: "n1"}}
	put(g, sn, func() {
		sn.Status.Disks = []v1.DiskStatus{{Name: "default", Path: "/data", Capacity: qty("100Gi"), Available: qty("25Gi"), Scheduled: qty("50Gi")}}
	})
	now := time.Now()
	for i, ev := range []struct{ typ, reason, msg string }{
		{corev1.EventTypeNormal, "Attached", "attached to n1"},
		{corev1.EventTypeWarning, "ReplicaFailed", "replica vol-a-r2 stopped serving"},
	} {
		put(g, &corev1.Event{ObjectMeta: om("ev-" + ev.reason), InvolvedObject: corev1.ObjectReference{Kind: "Volume", Name: "vol-a", Namespace: ns},
			Type: ev.typ, Reason: ev.reason, Message: ev.msg, LastTimestamp: metav1.NewTime(now.Add(time.Duration(i) * time.Minute))}, nil)
	}

	bk := &v1.Backup{ObjectMeta: om("nightly-1"), Spec: v1.BackupSpec{Volume: "vol-a", Target: "offsite"}}
	put(g, bk, func() {
		bk.Status.State, bk.Status.BytesDone, bk.Status.BytesTotal, bk.Status.UploadedBytes = v1.BackupStateInProgress, 3<<20, 4<<20, 2<<20
		bk.Status.Message = "uploading snapshot nightly-1"
	})

	g.Expect(k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ui-page-app"}})).To(Succeed())
	boundClaim(g, "ui-page-app", "data", "vol-a")
	srv := &Server{Client: k8sClient, Events: k8sClient, Claims: k8sClient, Namespace: ns}
	resp, page := get(g, srv, "/")
	g.Expect(resp.StatusCode).To(Equal(http.StatusOK))
	g.Expect(resp.Header.Get("Content-Type")).To(Equal("text/html; charset=utf-8"))
	g.Expect(resp.Header.Get("Content-Security-Policy")).To(ContainSubstring("default-src 'none'"), "the page runs no script")
	g.Expect(page).To(ContainSubstring("2 volumes: 0 healthy, 1 degraded, 0 faulted"))

	rowA := section(page, `<tr class="volume" data-volume="vol-a">`, "</tr>")
	g.Expect(rowA).To(ContainSubstring(`<td class="claim"><a href="?volume=ui-page-app%2fdata">ui-page-app/data</a></td>`), "the volume's claim")
	g.Expect(rowA).To(ContainSubstring(`<span class="badge attached">attached</span>`))
	g.Expect(rowA).To(ContainSubstring(`<span class="badge degraded">degraded</span>`))
	g.Expect(rowA).To(ContainSubstring(`<td class="used">12Mi</td>`))
	g.Expect(rowA).To(ContainSubstring("<td>n1</td>"))
	g.Expect(rowA).To(ContainSubstring("<td>1</td>"), "one replica RW")
	g.Expect(rowA).To(ContainSubstring("1 of 2 replicas placed: no disk has room"))
	g.Expect(rowA).NotTo(ContainSubstring("not the message to show"), "the Rebuilding condition is shown in its own section")
	g.Expect(rowA).NotTo(ContainSubstring(`class="spark`), "no sparkline without samples")

	rowB := section(page, `<tr class="volume" data-volume="vol-b">`, "</tr>")
	g.Expect(rowB).To(ContainSubstring(`<td class="claim"><span class="muted">-</span></td>`), "no claim")
	g.Expect(rowB).To(ContainSubstring(`<span class="badge unknown">unknown</span>`))
	g.Expect(rowB).To(ContainSubstring(`&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; waits`))
	g.Expect(page).NotTo(ContainSubstring("<script>"), "text from objects is escaped")

	backups := section(page, `<section id="backups">`, "</section>")
	g.Expect(backups).To(ContainSubstring("<td>vol-a</td><td>nightly-1</td><td>offsite</td>"), "the backup's volume, name and target")
	g.Expect(backups).To(ContainSubstring(`<span class="badge inProgress">inProgress</span>`))
	g.Expect(backups).To(ContainSubstring("75% · 3.0 MiB / 4.0 MiB"), "its progress")
	g.Expect(backups).To(ContainSubstring("uploading snapshot nightly-1"))
	rebuilds := section(page, `<section id="rebuilds">`, "</section>")
	g.Expect(rebuilds).To(ContainSubstring("<td>vol-a</td><td>vol-a-r2</td><td>vol-a-r1</td><td>changed regions</td>"))
	g.Expect(rebuilds).To(ContainSubstring(`<span style="width: 25%">`))
	g.Expect(rebuilds).To(ContainSubstring("25% · 1.0 MiB / 4.0 MiB"))

	n1 := section(page, `<div class="node" data-node="n1">`, "</table>")
	g.Expect(n1).To(ContainSubstring(`<span class="sched" style="width: 50%"></span><span style="width: 75%"></span>`))
	g.Expect(n1).To(ContainSubstring("25.0 GiB free of 100.0 GiB, 50.0 GiB scheduled"))
	g.Expect(n1).To(ContainSubstring(`<td class="replica-name">vol-a-r1<div class="muted">vol-a · ui-page-app/data</div></td>` +
		`<td class="pills"><span class="badge RW">RW</span><span class="badge running">running</span></td>`))
	n2 := section(page, `<div class="node" data-node="n2">`, "</table>")
	g.Expect(n2).To(ContainSubstring(`<span class="badge WO">WO</span>`), "a node with replicas and no StorageNode is shown")
	g.Expect(page).NotTo(ContainSubstring("vol-b-r1"), "an unplaced replica is on no node")

	events := section(page, `<section id="events">`, "</section>")
	g.Expect(events).To(MatchRegexp(`(?s)ReplicaFailed.*Attached`), "the newest event first")
	g.Expect(events).To(ContainSubstring(`<td class="Warning">Warning</td><td>volume/vol-a</td>`))

	resp, _ = get(g, &Server{Client: k8sClient, Namespace: ns}, "/other")
	g.Expect(resp.StatusCode).To(Equal(http.StatusNotFound))

	// One volume, by its claim or its name: only its row, replicas and
	// rebuilds.
	for _, filter := range []string{"ui-page-app/data", "vol-a"} {
		resp, page = get(g, srv, "/?volume="+filter)
		g.Expect(resp.StatusCode).To(Equal(http.StatusOK), filter)
		g.Expect(page).To(ContainSubstring(`data-volume="vol-a"`), filter)
		g.Expect(page).NotTo(ContainSubstring(`data-volume="vol-b"`), filter)
		g.Expect(page).To(ContainSubstring(`value="`+filter+`"`), "the form shows what was asked")
		g.Expect(page).NotTo(ContainSubstring(`id="notice"`))
	}
	_, page = get(g, srv, "/?volume=vol-b")
	g.Expect(page).NotTo(ContainSubstring(`data-replica="vol-a-r1"`), "another volume's replicas")
	// A filter that names no volume: 404, a notice with the cause, and
	// every volume.
	for filter, says := range map[string]string{
		"ui-page-app/nope": "no PersistentVolumeClaim nope in namespace ui-page-app",
		"nope":             "no volume nope in namespace ui-page",
	} {
		resp, page = get(g, srv, "/?volume="+filter)
		g.Expect(resp.StatusCode).To(Equal(http.StatusNotFound), filter)
		g.Expect(section(page, `<p class="notice" id="notice">`, "</p>")).To(ContainSubstring(says))
		g.Expect(page).To(ContainSubstring(`data-volume="vol-b"`), filter)
	}
}

// failing is an API server that cannot be read.
type failing struct{ client.Reader }

var errDown = errors.New("the API server is unreachable")

func (failing) List(context.Context, client.ObjectList, ...client.ListOption) error { return errDown }

// TestPageErrors: objects that cannot be listed are a 500 that says why;
// events that cannot be listed leave them out and show the rest.
func TestPageErrors(t *testing.T) {
	g := NewWithT(t)
	resp, body := get(g, &Server{Client: failing{}, Namespace: "default"}, "/")
	g.Expect(resp.StatusCode).To(Equal(http.StatusInternalServerError))
	g.Expect(body).To(ContainSubstring(errDown.Error()))

	resp, body = get(g, &Server{Client: k8sClient, Events: failing{}, Namespace: "ui-empty"}, "/")
	g.Expect(resp.StatusCode).To(Equal(http.StatusOK))
	g.Expect(body).To(ContainSubstring("No volumes."))
	g.Expect(body).To(ContainSubstring("No events."))
}

// TestSpark: the sparkline's points fill the box from the right, scaled
// to the largest value (at least 1).
func TestSpark(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		want Spark
	}{
		{nil, Spark{}},
		{[]float64{0}, Spark{Points: "120.0,23.0", Last: 0, Max: 1}},
		{[]float64{5, 10}, Spark{Points: "118.0,12.0 120.0,1.0", Last: 10, Max: 10}},
		{[]float64{0.5}, Spark{Points: "120.0,12.0", Last: 0.5, Max: 1}},
	} {
		if got := spark(tc.xs); got != tc.want {
			t.Errorf("spark(%v) = %+v, want %+v", tc.xs, got, tc.want)
		}
	}
}

// counters is an engine's Metrics answer, set by the test.
type counters struct {
	enginev1.EngineServiceClient
	reads, writes uint64
}

func (c *counters) Metrics(context.Context, *enginev1.MetricsRequest, ...grpc.CallOption) (*enginev1.MetricsResponse, error) {
	return &enginev1.MetricsResponse{Read: &enginev1.OpMetrics{Ops: c.reads}, Write: &enginev1.OpMetrics{Ops: c.writes}}, nil
}

type engines map[types.NamespacedName]*engine.Conn

func (es engines) Each(fn func(types.NamespacedName, *engine.Conn)) {
	for k, c := range es {
		fn(k, c)
	}
}

// TestSample: each sample adds the rates since the previous one; a
// counter that went down (a restarted engine) starts the series over; a
// series keeps at most historyLen rates; an engine gone loses its series.
func TestSample(t *testing.T) {
	key := types.NamespacedName{Namespace: "default", Name: "vol-e"}
	c := &counters{}
	es := engines{key: &engine.Conn{Client: c}}
	s := &Server{Engines: func() metrics.Engines { return es }}
	rates := func() (int, int) {
		h := s.history[key]
		if h == nil {
			return -1, -1
		}
		return len(h.readRates), len(h.writeRates)
	}
	ctx := context.Background()
	s.Sample(ctx)
	if r, w := rates(); r != 0 || w != 0 {
		t.Fatalf("after one sample: %d, %d rates", r, w)
	}
	c.reads, c.writes = 100, 50
	s.Sample(ctx)
	if r, w := rates(); r != 1 || w != 1 || s.history[key].readRates[0] <= 0 || s.history[key].writeRates[0] <= 0 {
		t.Fatalf("after I/O: %+v", s.history[key])
	}
	c.reads = 10 // restarted
	s.Sample(ctx)
	if r, _ := rates(); r != 1 {
		t.Fatalf("a counter going down added a rate (%d)", r)
	}
	for range historyLen + 5 {
		c.reads, c.writes = c.reads+1, c.writes+1
		s.Sample(ctx)
	}
	if r, w := rates(); r != historyLen || w != historyLen {
		t.Fatalf("%d, %d rates kept, want %d", r, w, historyLen)
	}
	delete(es, key)
	s.Sample(ctx)
	if _, ok := s.history[key]; ok {
		t.Fatal("a gone engine kept its series")
	}
}
