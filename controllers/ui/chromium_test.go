package ui

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/claims"
	"github.com/cairn-io/cairn/controllers/internal/browser"
)

// measure is a page that loads the web page in a 1280 px wide frame and,
// once it is laid out, writes what a person would see wrong into
// #result as JSON: elements of a node card that stick out of it, cards
// that overlap, badges (the replica pills) that overlap, text cut off,
// and a page wider than the frame. The web page itself runs no script
// (its Content-Security-Policy forbids it); this page, from the same
// origin, reads its layout through the frame.
const measure = `<!DOCTYPE html>
<html><head><meta charset="utf-8"></head><body style="margin:0">
<iframe id="page" src="%s" style="width:1280px;height:6000px;border:0;display:block"></iframe>
<pre id="result">not measured</pre>
<script>
document.getElementById('page').addEventListener('load', function () {
  var d = this.contentDocument, out = {cards: 0, badges: 0, outside: [], cardOverlaps: [], badgeOverlaps: [], clipped: [], pageWidth: 0};
  var cut = 0.5;
  function r(e) { return e.getBoundingClientRect(); }
  function overlap(a, b) { return Math.min(a.right, b.right) - Math.max(a.left, b.left) > cut && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > cut; }
  function name(e) { return e.tagName.toLowerCase() + (e.className ? '.' + e.className : '') + ' "' + (e.textContent || '').trim().slice(0, 40) + '"'; }
  var cards = Array.prototype.slice.call(d.querySelectorAll('.node'));
  out.cards = cards.length;
  cards.forEach(function (c, i) {
    var cr = r(c);
    if (c.scrollWidth > c.clientWidth) out.outside.push(c.dataset.node + ': scrollWidth ' + c.scrollWidth + ' > ' + c.clientWidth);
    c.querySelectorAll('*').forEach(function (e) {
      var er = r(e);
      if (er.width === 0 && er.height === 0) return;
      if (er.left < cr.left - cut || er.right > cr.right + cut) out.outside.push(c.dataset.node + ': ' + name(e) + ' spans ' + er.left + '..' + er.right + ', card ' + cr.left + '..' + cr.right);
    });
    cards.slice(i + 1).forEach(function (o) { if (overlap(cr, r(o))) out.cardOverlaps.push(c.dataset.node + ' / ' + o.dataset.node); });
  });
  var badges = Array.prototype.slice.call(d.querySelectorAll('.badge'));
  out.badges = badges.length;
  badges.forEach(function (b, i) {
    var br = r(b);
    badges.slice(i + 1).forEach(function (o) { if (overlap(br, r(o))) out.badgeOverlaps.push(name(b) + ' / ' + name(o)); });
  });
  d.querySelectorAll('.node td, .node div, .node span').forEach(function (e) {
    if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible') out.clipped.push(name(e));
  });
  out.pageWidth = d.documentElement.scrollWidth;
  document.getElementById('result').textContent = JSON.stringify(out);
});
</script></body></html>`

// layout is what measure reports.
type layout struct {
	Cards         int      `json:"cards"`
	Badges        int      `json:"badges"`
	Outside       []string `json:"outside"`
	CardOverlaps  []string `json:"cardOverlaps"`
	BadgeOverlaps []string `json:"badgeOverlaps"`
	Clipped       []string `json:"clipped"`
	PageWidth     float64  `json:"pageWidth"`
}

// TestLayout renders the page in headless Chromium at 1280 px wide with
// what a real cluster shows (volumes named after their PersistentVolumes,
// replicas named after them, claims, long node names, several replicas
// per node) and checks what a person sees: every node card holds its
// content, no two cards overlap, no two replica pills overlap, no text is
// cut off, and the page is no wider than the window.
// CAIRN_UI_SCREENSHOT=FILE saves a screenshot of the page at that width.
func TestLayout(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	const ns = "ui-layout"
	g.Expect(k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	g.Expect(k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "databases"}})).To(Succeed())
	nodes := []string{"ip-10-0-12-34.eu-west-1.compute.internal", "ip-10-0-56-78.eu-west-1.compute.internal", "ip-10-0-90-12.eu-west-1.compute.internal"}
	for _, n := range nodes {
		sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: ns}, Spec: v1.StorageNodeSpec{NodeName: n}}
		put(g, sn, func() {
			sn.Status.Disks = []v1.DiskStatus{{Name: "nvme-data-0", Path: "/var/lib/cairn/replicas", Capacity: qty("1863Gi"), Available: qty("1210Gi"), Scheduled: qty("700Gi")}}
		})
	}
	modes := []v1.ReplicaMode{v1.ReplicaModeRW, v1.ReplicaModeWO, v1.ReplicaModeERR}
	for i := range 6 {
		name := fmt.Sprintf("pvc-3f0e1d2c-8b9a-4c5d-9e7f-0123456789%02d", i)
		claim := fmt.Sprintf("data-postgres-cluster-%d", i)
		vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: v1.VolumeSpec{Size: resource.MustParse("100Gi"), NumberOfReplicas: 3}}
		put(g, vol, func() {
			vol.Status.State, vol.Status.Robustness, vol.Status.CurrentNodeName = v1.VolumeStateAttached, v1.VolumeRobustnessDegraded, nodes[i%3]
			cond(&vol.Status.Conditions, v1.ConditionReady, false, v1.ReasonReconciling, "replica "+name+"-r-x9k2m on "+nodes[2]+" failed: connection refused")
		})
		boundClaim(g, "databases", claim, name)
		e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: name + "-e", Namespace: ns}, Spec: v1.EngineSpec{VolumeName: name, Size: resource.MustParse("100Gi")}}
		modeMap := map[string]v1.ReplicaMode{}
		for j, n := range nodes {
			rep := &v1.Replica{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-r-%c%c7q2", name, 'a'+j, 'k'+i), Namespace: ns},
				Spec: v1.ReplicaSpec{VolumeName: name, NodeName: n, Size: resource.MustParse("100Gi")}}
			states := []v1.InstanceState{v1.InstanceStateRunning, v1.InstanceStateStarting, v1.InstanceStateUnknown}
			put(g, rep, func() { rep.Status.InstanceState = states[(i+j)%3] })
			modeMap[rep.Name] = modes[(i+j)%3]
		}
		put(g, e, func() { e.Status.ReplicaModeMap = modeMap })
	}
	mux := http.NewServeMux()
	mux.Handle("/", &Server{Client: k8sClient, Events: k8sClient, Claims: k8sClient, Namespace: ns})
	mux.HandleFunc("/measure", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, measure, "/")
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	if shot := os.Getenv("CAIRN_UI_SCREENSHOT"); shot != "" {
		browser.Render(t, srv.URL+"/", browser.Options{Width: 1280, Height: 1700, Screenshot: shot})
	}
	dom := browser.Render(t, srv.URL+"/measure", browser.Options{Width: 1280, Height: 1700})
	m := regexp.MustCompile(`<pre id="result">(.*?)</pre>`).FindStringSubmatch(dom)
	g.Expect(m).To(HaveLen(2), "no result in:\n%s", dom)
	var got layout
	g.Expect(json.Unmarshal([]byte(strings.ReplaceAll(m[1], "&quot;", `"`)), &got)).To(Succeed(), m[1])
	g.Expect(got.Cards).To(Equal(3), "a card per node")
	g.Expect(got.Badges).To(BeNumerically(">=", 2*18), "a mode and a state pill per replica")
	g.Expect(got.Outside).To(BeEmpty(), "content sticking out of node cards")
	g.Expect(got.CardOverlaps).To(BeEmpty(), "node cards overlapping")
	g.Expect(got.BadgeOverlaps).To(BeEmpty(), "pills overlapping")
	g.Expect(got.Clipped).To(BeEmpty(), "text cut off")
	g.Expect(got.PageWidth).To(BeNumerically("<=", 1280), "the page scrolls sideways")
}

// boundClaim makes a claim bound to the Cairn PersistentVolume of volume.
func boundClaim(g *WithT, ns, name, volume string) {
	ctx := context.Background()
	size := resource.MustParse("1Gi")
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: volume,
		Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}}}}
	put(g, pvc, func() { pvc.Status.Phase = corev1.ClaimBound })
	g.Expect(k8sClient.Create(ctx, &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: volume}, Spec: corev1.PersistentVolumeSpec{
		Capacity: corev1.ResourceList{corev1.ResourceStorage: size}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: claims.DriverName, VolumeHandle: volume}},
		ClaimRef:               &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: name, UID: pvc.UID}}})).To(Succeed())
}
