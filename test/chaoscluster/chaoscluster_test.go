//go:build chaoscluster

package chaoscluster

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"reflect"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

var (
	schedules = flag.Int("chaoscluster.schedules", 1, "number of schedules")
	seedFlag  = flag.Uint64("chaoscluster.seed", 0, "seed of the first schedule (the next ones use seed+1, ...); 0 picks one from the clock")
	steps     = flag.Int("chaoscluster.steps", 4, "faults per schedule")
	faultsArg = flag.String("chaoscluster.faults", "", "comma-separated fault kinds the nemesis draws from (default: all)")
	kubeCtx   = flag.String("chaoscluster.context", "", "kubectl context (default kind-$CLUSTER, else kind-cairn-e2e)")
	appImage  = flag.String("chaoscluster.app-image", envOr("E2E_APP_IMAGE", "kind-offline/e2e-tools:local"), "image of the writer pods (sh, dd, sha256sum), loaded into the nodes")
	fioImage  = flag.String("chaoscluster.fio-image", envOr("E2E_FIO_IMAGE", "cairn-e2e-fio:local"), "image of the fio pod, loaded into the nodes")
)

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}

// replay is the command that runs one schedule again.
func replay(seed uint64) string {
	cmd := fmt.Sprintf("make chaos-cluster SCHEDULES=1 SEED=%d", seed)
	if *steps != 4 {
		cmd += fmt.Sprintf(" STEPS=%d", *steps)
	}
	if *faultsArg != "" {
		cmd += " FAULTS=" + *faultsArg
	}
	return cmd
}

// TestChaosCluster runs whole-stack fault schedules on the kind cluster
// of the current context (Cairn deployed in cairn-system).
func TestChaosCluster(t *testing.T) {
	faults, err := parseFaultsFlag()
	if err != nil {
		t.Fatalf("-chaoscluster.faults: %v", err)
	}
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano() % 1e9)
	}
	c := &cluster{context: *kubeCtx, log: os.Stdout}
	if c.context == "" {
		c.context = "kind-" + envOr("CLUSTER", "cairn-e2e")
	}
	// Ctrl-C or SIGTERM ends the running schedule after its current
	// step; it is healed, checked and cleaned up, and no other starts.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := c.discover(ctx); err != nil {
		t.Fatalf("the cluster (context %s) is not ready for a run: %v", c.context, err)
	}
	if left := (&runner{c: c}).leftovers(ctx); len(left) > 0 {
		fmt.Printf("removed what an earlier run left: %s\n", strings.Join(left, ", "))
	}
	fmt.Printf("cluster %s: nodes %v (control plane %s)\n", c.context, c.nodes, c.controlPlane)
	seen := map[Fault]int{}
	n, violations := 0, 0
	for i := range *schedules {
		if ctx.Err() != nil {
			break
		}
		cfg := Config{Seed: seed + uint64(i), Steps: *steps, Faults: faults, Images: images{app: *appImage, fio: *fioImage}}
		fmt.Printf("schedule seed=%d (replay: %s)\n", cfg.Seed, replay(cfg.Seed))
		r := Run(ctx, c, cfg)
		n++
		report(t, r)
		for _, s := range r.Schedule[:len(r.Done)] {
			seen[s.Fault]++
		}
		if len(r.Problems) > 0 {
			violations++
		}
		if r.Setup != nil {
			break // the next schedule would fail the same way
		}
		if err := poll(context.Background(), healthyBound, 5*time.Second, func() (bool, error) {
			err := c.healthyCluster(context.Background())
			return err == nil, err
		}); err != nil {
			t.Fatalf("the cluster is not healthy after seed %d: %v", cfg.Seed, err)
		}
	}
	fmt.Printf("%d schedules, %d violations, faults injected: %s\n", n, violations, countLine(seen))
}

func parseFaultsFlag() ([]Fault, error) {
	if *faultsArg == "" {
		return nil, nil
	}
	return ParseFaults(strings.Split(*faultsArg, ","))
}

func report(t *testing.T, r Result) {
	fmt.Println(r.Line())
	for i, d := range r.Done {
		fmt.Printf("  %d. %s\n", i+1, d)
	}
	for _, s := range r.Summary {
		fmt.Printf("  %s\n", s)
	}
	if len(r.Problems) > 0 {
		t.Errorf("seed %d: %s", r.Seed, strings.Join(r.Problems, "; "))
		fmt.Printf("  replay: %s\n", replay(r.Seed))
	}
}

func countLine(m map[Fault]int) string {
	var out []string
	for f, k := range m {
		out = append(out, fmt.Sprintf("%s=%d", f, k))
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// TestDrawReplays checks that a seed draws the same schedule every time,
// that other seeds draw others, that every kind is drawn, and that only
// control-only faults overlap (needs no cluster).
func TestDrawReplays(t *testing.T) {
	a, b := Draw(42, 6, nil), Draw(42, 6, nil)
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("seed 42 drew two schedules:\n%v\n%v", a, b)
	}
	if reflect.DeepEqual(a, Draw(43, 6, nil)) {
		t.Fatalf("seeds 42 and 43 drew the same schedule %v", a)
	}
	seen := map[Fault]bool{}
	for seed := range uint64(200) {
		s := Draw(seed, 4, nil)
		for i, st := range s {
			seen[st.Fault] = true
			next := i+1 < len(s) && s[i+1].Fault.controlOnly()
			if st.Overlap && !st.Fault.controlOnly() && !next {
				t.Errorf("seed %d step %d: %s overlaps, next to no control-only fault", seed, i, st)
			}
			if st.Gap < 5*time.Second || st.Hold < 15*time.Second || st.Hold > 45*time.Second {
				t.Errorf("seed %d step %d: timing out of range: %s", seed, i, st)
			}
		}
	}
	if len(seen) != len(AllFaults) {
		t.Errorf("200 schedules drew only %d of %d kinds: %v", len(seen), len(AllFaults), seen)
	}
	only := Draw(7, 10, []Fault{FaultKillEngine})
	for _, st := range only {
		if st.Fault != FaultKillEngine {
			t.Fatalf("drew %s from [kill-engine]", st.Fault)
		}
	}
	if _, err := ParseFaults([]string{"kill-engine", "no-such-fault"}); err == nil {
		t.Fatal("an unknown fault kind was accepted")
	}
}
