package chaos

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

var (
	schedules = flag.Int("chaos.schedules", 0, "number of schedules; 0 runs the short version (until every fault kind has run once)")
	seedFlag  = flag.Uint64("chaos.seed", 0, "seed of the first schedule (the next ones use seed+1, ...); 0 picks one from the clock")
	duration  = flag.Duration("chaos.duration", 3*time.Second, "workload time per schedule")
	verbose   = flag.Bool("chaos.verbose", false, "print every fault as it is injected")
	unsafe    = flag.Bool("chaos.unsafe-engine", false, "run the deliberately broken engine (to replay TestChaosCatchesBrokenEngine)")
)

var cairnData string

func TestMain(m *testing.M) {
	flag.Parse()
	code := func() int {
		if testing.Short() {
			return m.Run()
		}
		dir, err := os.MkdirTemp("", "cairn-chaos-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		cairnData = os.Getenv("CAIRN_DATA")
		if cairnData == "" {
			cairnData = filepath.Join(dir, "cairn-data")
			out, err := exec.Command("go", "build", "-o", cairnData, "../../cmd/cairn-data").CombinedOutput()
			if err != nil {
				fmt.Fprintf(os.Stderr, "building cairn-data: %v\n%s", err, out)
				return 1
			}
		}
		return m.Run()
	}()
	os.Exit(code)
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: iptables partitions and a tmpfs disk (CI runs as root)")
	}
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skip("needs iptables (make test installs it: hack/install-test-tools.sh)")
	}
	if testing.Short() {
		t.Skip("chaos schedules are skipped with -short")
	}
}

func config(seed uint64) Config {
	cfg := Config{Bin: cairnData, Work: os.TempDir(), Seed: seed, Duration: *duration, DiskFaults: true, UnsafeEngine: *unsafe}
	if *verbose {
		cfg.Verbose = os.Stdout
	}
	return cfg
}

func report(t *testing.T, r Result) {
	fmt.Println(r.Line())
	if len(r.Problems) == 0 {
		return
	}
	t.Errorf("seed %d: %s", r.Seed, strings.Join(r.Problems, "; "))
	replay := fmt.Sprintf("make chaos SCHEDULES=1 SEED=%d", r.Seed)
	if *unsafe {
		replay += " UNSAFE=1"
	}
	fmt.Printf("  replay: %s\n", replay)
	if r.Explanation != "" {
		fmt.Print("  " + r.Explanation)
	}
	if r.Visualization != "" {
		fmt.Printf("  history (open in a browser; the red operations are where no linearization exists): %s\n", r.Visualization)
	}
	if r.Dir != "" {
		fmt.Printf("  logs of every process: %s\n", r.Dir)
	}
}

// TestChaos runs randomized fault schedules against the real data plane.
// Without -chaos.schedules it is the short version make test runs: new
// schedules until every fault kind has been injected at least once.
func TestChaos(t *testing.T) {
	needRoot(t)
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano() % 1e9)
	}
	// Ctrl-C (SIGINT to the process group) or SIGTERM ends the running
	// schedule early; it is checked and torn down, and no other starts.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	n, ops, violations := 0, 0, 0
	seen := map[Fault]int{}
	for i := 0; ; i++ {
		if ctx.Err() != nil {
			fmt.Printf("interrupted after %d schedules: nothing left running or mounted\n", n)
			break
		}
		if *schedules > 0 && i >= *schedules {
			break
		}
		if *schedules == 0 && (len(seen) == len(AllFaults) || i >= 12) {
			break
		}
		r := Run(ctx, config(seed+uint64(i)))
		report(t, r)
		n++
		ops += r.Ops
		if len(r.Problems) > 0 {
			violations++
		}
		for f, k := range r.Faults {
			seen[f] += k
		}
	}
	fmt.Printf("%d schedules, %d ops, %d violations\n", n, ops, violations)
	if *schedules == 0 && ctx.Err() == nil {
		for _, f := range AllFaults {
			if seen[f] == 0 {
				t.Errorf("fault %s never ran in the short version", f)
			}
		}
	}
}

// TestChaosCatchesBrokenEngine runs the engine in its deliberately broken
// mode (writes acknowledged before every replica has them) and checks that
// the harness reports a violation with a seed to replay it.
func TestChaosCatchesBrokenEngine(t *testing.T) {
	needRoot(t)
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano() % 1e9)
	}
	for i := range 10 {
		cfg := config(seed + uint64(i))
		cfg.UnsafeEngine = true
		cfg.Faults = []Fault{FaultPauseReplica, FaultKillReplica, FaultRejoinReplica}
		r := Run(context.Background(), cfg)
		fmt.Println("broken engine:", r.Line())
		if len(r.Problems) > 0 {
			fmt.Printf("  caught; replay with: make chaos SCHEDULES=1 SEED=%d UNSAFE=1\n", r.Seed)
			if r.Explanation != "" {
				fmt.Print("  " + r.Explanation)
			}
			if r.Dir != "" {
				os.RemoveAll(r.Dir)
			}
			return
		}
	}
	t.Fatal("the harness did not catch an engine that acknowledges writes early in 10 schedules")
}
