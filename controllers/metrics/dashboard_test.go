package metrics

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestDashboardQueriesExposedMetrics: every cairn_ metric the Grafana
// dashboard (config/monitoring) queries is one the Collector describes
// (with a histogram's _bucket suffix for histograms), and every panel
// has a query.
func TestDashboardQueriesExposedMetrics(t *testing.T) {
	b, err := os.ReadFile("../../config/monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	exposed := map[string]bool{}
	ch := make(chan *prometheus.Desc, 64)
	(&Collector{}).Describe(ch)
	close(ch)
	nameRE := regexp.MustCompile(`fqName: "([a-z_]+)"`)
	for d := range ch {
		m := nameRE.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("no name in %s", d)
		}
		exposed[m[1]] = true
		if strings.HasSuffix(m[1], "_seconds") {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				exposed[m[1]+s] = true
			}
		}
	}
	used := regexp.MustCompile(`cairn_[a-z_]+`)
	panels := 0
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		panels++
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			names := used.FindAllString(tg.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: %q queries no Cairn metric", p.Title, tg.Expr)
			}
			for _, n := range names {
				if !exposed[n] {
					t.Errorf("panel %q queries %s, which the manager does not expose", p.Title, n)
				}
			}
		}
	}
	if panels < 10 {
		t.Fatalf("only %d panels", panels)
	}
}
