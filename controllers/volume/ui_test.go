package volume

import (
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/browser"
	"github.com/cairn-io/cairn/controllers/metrics"
	"github.com/cairn-io/cairn/controllers/ui"
)

// TestUI loads the manager's page in a real headless browser while a real
// volume runs and checks what a person would see: the volume, attached
// and healthy, with read and write sparklines after I/O; its replicas on
// their nodes in RW; the nodes' disks; the events. CAIRN_UI_SCREENSHOT=FILE
// also saves a screenshot (docs/ui.png is one).
func TestUI(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "ui-a", "ui-b")
	page := &ui.Server{Client: k8sClient, Events: k8sClient, Namespace: "default",
		Engines: func() metrics.Engines { return engines.Engines }}
	srv := httptest.NewServer(page)
	defer srv.Close()

	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "shown", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	setNode(g, key, "ui-a")
	sock := waitAttached(t, g, key).Status.Endpoint
	g.Eventually(func() v1.VolumeRobustness { return getVolume(g, key).Status.Robustness }, timeout, 100*time.Millisecond).
		Should(Equal(v1.VolumeRobustnessHealthy))
	g.Eventually(func() int { return rwReplicas(g, vol) }, timeout, 100*time.Millisecond).Should(Equal(2))
	page.Sample(ctx)
	for i, mib := range []string{"2M", "8M", "4M", "12M", "6M"} {
		qemuIO(t, vol.Name, sock, "write -P 0x4"+string(rune('0'+i))+" 0 "+mib, "read 0 "+mib, "flush")
		page.Sample(ctx)
	}

	// The data written (12 MiB at most, from offset 0) as the volume's
	// actual size, which the engine samples every 10 s.
	g.Eventually(func() string {
		if q := getVolume(g, key).Status.ActualSize; q != nil {
			return q.String()
		}
		return ""
	}, timeout, 200*time.Millisecond).Should(Equal("12Mi"))

	dom := browser.Render(t, srv.URL, browser.Options{Width: 1280, Height: 900, Screenshot: os.Getenv("CAIRN_UI_SCREENSHOT")})
	row := regexp.MustCompile(`(?s)<tr class="volume" data-volume="shown">.*?</tr>`).FindString(dom)
	g.Expect(row).NotTo(BeEmpty(), "the volume's row:\n%s", dom)
	g.Expect(row).To(ContainSubstring(`<span class="badge attached">attached</span>`))
	g.Expect(row).To(ContainSubstring(`<span class="badge healthy">healthy</span>`))
	g.Expect(row).To(ContainSubstring("ui-a"))
	g.Expect(row).To(ContainSubstring(`<td class="used">12Mi</td>`))
	g.Expect(row).To(MatchRegexp(`<svg class="spark reads"[^>]*><polyline points="[0-9., ]+"`), "a read sparkline")
	g.Expect(row).To(MatchRegexp(`<svg class="spark writes"[^>]*><polyline points="[0-9., ]+"`), "a write sparkline")
	for _, n := range []string{"ui-a", "ui-b"} {
		node := regexp.MustCompile(`(?s)<div class="node" data-node="` + n + `">.*?</table>`).FindString(dom)
		g.Expect(node).To(ContainSubstring(`<span class="badge RW">RW</span>`), "a replica of the volume in RW on %s", n)
		g.Expect(node).To(ContainSubstring("shown"))
		g.Expect(node).To(MatchRegexp(`free of [0-9.]+ [KMGT]iB`), "the disk of %s", n)
	}
	g.Expect(dom).To(ContainSubstring("volume/shown"), "the volume's events")
	g.Expect(dom).To(ContainSubstring("Attached"))
	g.Expect(strings.Count(dom, `class="volume"`)).To(BeNumerically(">=", 1))
}
