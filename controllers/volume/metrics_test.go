package volume

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/metrics"
	"github.com/cairn-io/cairn/controllers/replica"
)

// scrape fetches url as Prometheus does and parses the text format.
func scrape(g *WithT, url string) map[string]*dto.MetricFamily {
	resp, err := http.Get(url)
	g.Expect(err).NotTo(HaveOccurred())
	defer resp.Body.Close()
	g.Expect(resp.StatusCode).To(Equal(http.StatusOK))
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	g.Expect(err).NotTo(HaveOccurred())
	return fams
}

// value returns the value of family's sample with labels (a counter,
// gauge, or a histogram's count), or -1 when there is none.
func value(fams map[string]*dto.MetricFamily, family string, labels map[string]string) float64 {
	f, ok := fams[family]
	if !ok {
		return -1
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return -1
}

// TestMetrics scrapes the collector over HTTP while a real volume runs:
// its size, state and robustness, its replicas' modes, the disks and the
// instance managers' processes are there, and the I/O counters and the
// latency histogram grow with the writes and reads qemu-io makes through
// the engine.
func TestMetrics(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (make test-tools installs it)")
	}
	g := NewWithT(t)
	ctx := context.Background()
	startNodes(t, g, "mt-a", "mt-b")
	reg := prometheus.NewRegistry()
	reg.MustRegister(&metrics.Collector{Client: k8sClient, Engines: func() metrics.Engines { return engines.Engines }})
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	defer srv.Close()

	vol := &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "metered", Namespace: "default"}, Spec: v1.VolumeSpec{
		Size: resource.MustParse("16Mi"), NumberOfReplicas: 2, Frontend: v1.FrontendNBD}}
	g.Expect(k8sClient.Create(ctx, vol)).To(Succeed())
	key := client.ObjectKeyFromObject(vol)
	cleanupVolume(t, vol)
	waitDetached(t, g, key)
	fams := scrape(g, srv.URL)
	vl := map[string]string{"namespace": "default", "volume": "metered"}
	g.Expect(value(fams, "cairn_volume_size_bytes", vl)).To(Equal(float64(16 << 20)))
	g.Expect(value(fams, "cairn_volume_state", map[string]string{"volume": "metered", "state": "detached"})).To(Equal(1.0))
	g.Expect(value(fams, "cairn_volume_state", map[string]string{"volume": "metered", "state": "attached"})).To(Equal(0.0))
	g.Expect(value(fams, "cairn_disk_capacity_bytes", map[string]string{"node": "mt-a"})).To(BeNumerically(">", 0))
	g.Expect(value(fams, "cairn_disk_available_bytes", map[string]string{"node": "mt-a"})).To(BeNumerically(">", 0))

	setNode(g, key, "mt-a")
	sock := waitAttached(t, g, key).Status.Endpoint
	g.Eventually(func() float64 {
		return value(scrape(g, srv.URL), "cairn_volume_robustness", map[string]string{"volume": "metered", "robustness": "healthy"})
	}, timeout, 100*time.Millisecond).Should(Equal(1.0))
	writes := map[string]string{"volume": "metered", "op": "write"}
	var before float64
	g.Eventually(func() float64 {
		before = value(scrape(g, srv.URL), "cairn_volume_operations_total", writes)
		return before
	}, timeout, 100*time.Millisecond).Should(BeNumerically(">=", 0), "the engine's counters are scraped once it runs")

	qemuIO(t, vol.Name, sock, "write -P 0x5a 0 4M", "flush", "read -P 0x5a 0 4M")
	fams = scrape(g, srv.URL)
	g.Expect(value(fams, "cairn_volume_operations_total", writes)).To(BeNumerically(">", before), "writes counted")
	g.Expect(value(fams, "cairn_volume_operation_bytes_total", writes)).To(BeNumerically(">=", 4<<20))
	g.Expect(value(fams, "cairn_volume_operation_bytes_total", map[string]string{"volume": "metered", "op": "read"})).To(BeNumerically(">=", 4<<20))
	g.Expect(value(fams, "cairn_volume_operation_duration_seconds", writes)).To(BeNumerically(">", 0), "latency histogram")
	g.Expect(value(fams, "cairn_volume_operation_errors_total", writes)).To(Equal(0.0))
	// The data written shows in the Volume's actual size (the engine
	// samples it every 10 s) and its gauge.
	g.Eventually(func() float64 {
		return value(scrape(g, srv.URL), "cairn_volume_actual_size_bytes", vl)
	}, timeout, 200*time.Millisecond).Should(Equal(float64(4 << 20)))
	g.Expect(getVolume(g, key).Status.ActualSize.Value()).To(Equal(int64(4 << 20)))
	rw := 0
	for _, m := range fams["cairn_replica_mode"].GetMetric() {
		l := map[string]string{}
		for _, p := range m.Label {
			l[p.GetName()] = p.GetValue()
		}
		if l["volume"] == "metered" && l["mode"] == "RW" && m.Gauge.GetValue() == 1 {
			rw++
		}
	}
	g.Expect(rw).To(Equal(2), "both replicas RW")
	g.Expect(value(fams, "cairn_instance_manager_processes", map[string]string{"node": "mt-a", "kind": "engine", "state": "running"})).To(Equal(1.0))

	// A replica process killed and resynced: its rebuild's progress is
	// there too. Then every metric the Grafana dashboard queries is in a
	// scrape of this running system.
	var victim v1.Replica
	for _, r := range listReplicas(g, vol) {
		if r.Spec.NodeName == "mt-b" {
			victim = r
		}
	}
	g.Expect(syscall.Kill(replicaPID(t, replica.DataDir(&victim)), syscall.SIGKILL)).To(Succeed())
	qemuIO(t, vol.Name, sock, "write -P 0x5b 8M 1M", "flush")
	rl := map[string]string{"volume": "metered", "replica": victim.Name}
	g.Eventually(func() bool {
		f := scrape(g, srv.URL)
		done, total := value(f, "cairn_volume_rebuild_bytes_done", rl), value(f, "cairn_volume_rebuild_bytes_total", rl)
		return total > 0 && done == total
	}, timeout, 100*time.Millisecond).Should(BeTrue(), "the resync's progress, done")
	g.Eventually(func() float64 {
		return value(scrape(g, srv.URL), "cairn_volume_robustness", map[string]string{"volume": "metered", "robustness": "healthy"})
	}, timeout, 100*time.Millisecond).Should(Equal(1.0))
	fams = scrape(g, srv.URL)
	b, err := os.ReadFile("../../config/monitoring/grafana-dashboard.json")
	g.Expect(err).NotTo(HaveOccurred())
	for _, name := range regexp.MustCompile(`cairn_[a-z_]+`).FindAllString(string(b), -1) {
		family := strings.TrimSuffix(name, "_bucket")
		g.Expect(fams).To(HaveKey(family), "the dashboard queries %s; the running system's scrape has no %s", name, family)
	}
}
