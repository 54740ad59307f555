package chaos

import (
	"context"
	"debug/buildinfo"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

var (
	schedules = flag.Int("chaos.schedules", 0, "number of schedules; 0 runs the short version (until every fault kind has run once)")
	seedFlag  = flag.Uint64("chaos.seed", 0, "seed of the first schedule (the next ones use seed+1, ...); 0 picks one from the clock")
	duration  = flag.Duration("chaos.duration", 3*time.Second, "workload time per schedule")
	verbose   = flag.Bool("chaos.verbose", false, "print every fault as it is injected")
	unsafe    = flag.Bool("chaos.unsafe-engine", false, "run the deliberately broken engine (to replay TestChaosCatchesBrokenEngine)")
	faultsArg = flag.String("chaos.faults", "", "comma-separated fault kinds the nemesis draws from (default: all)")
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
			out, err := exec.Command("go", "build", "-tags", "cairn_unsafe", "-o", cairnData, "../../cmd/cairn-data").CombinedOutput() // the tag builds in TestChaosCatchesBrokenEngine's unsafe engine
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

func config(t *testing.T, seed uint64) Config {
	cfg := Config{Bin: cairnData, Work: os.TempDir(), Seed: seed, Duration: *duration, DiskFaults: true, UnsafeEngine: *unsafe}
	if *verbose {
		cfg.Verbose = os.Stdout
	}
	if *faultsArg != "" {
		for _, f := range strings.Split(*faultsArg, ",") {
			if !slices.Contains(AllFaults, Fault(f)) {
				t.Fatalf("-chaos.faults: unknown fault %q (known: %v)", f, AllFaults)
			}
			cfg.Faults = append(cfg.Faults, Fault(f))
		}
	}
	return cfg
}

// replay is the command that runs cfg's schedule again.
func replay(cfg Config) string {
	cmd := fmt.Sprintf("make chaos SCHEDULES=1 SEED=%d", cfg.Seed)
	if len(cfg.Faults) > 0 && !slices.Equal(cfg.Faults, AllFaults) {
		var fs []string
		for _, f := range cfg.Faults {
			fs = append(fs, string(f))
		}
		cmd += " FAULTS=" + strings.Join(fs, ",")
	}
	if cfg.UnsafeEngine {
		cmd += " UNSAFE=1"
	}
	return cmd
}

func report(t *testing.T, r Result, cfg Config) {
	fmt.Println(r.Line())
	if len(r.Problems) == 0 {
		return
	}
	t.Errorf("seed %d: %s", r.Seed, strings.Join(r.Problems, "; "))
	fmt.Printf("  replay: %s\n", replay(cfg))
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
// schedules until every fault kind has been injected at least once. After
// the first shortAllFaults schedules, the nemesis draws only from the kinds
// not seen yet (and those they need: see needs), so a kind the dice keep
// missing still runs; the replay line names the set.
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
		cfg := config(t, seed+uint64(i))
		if *schedules == 0 && i >= shortAllFaults {
			cfg.Faults = unseen(seen)
		}
		r := Run(ctx, cfg)
		report(t, r, cfg)
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

// shortAllFaults is how many schedules of the short version draw from
// every fault kind before it turns to the ones not seen yet.
const shortAllFaults = 3

// needs names the fault kind another can only run after, in the same
// schedule: a deletion needs a snapshot, a rejoin a failed replica.
var needs = map[Fault]Fault{FaultDeleteSnapshot: FaultSnapshot, FaultRejoinReplica: FaultKillReplica}

// unseen lists the fault kinds seen has none of, with what they need.
func unseen(seen map[Fault]int) []Fault {
	want := map[Fault]bool{}
	for _, f := range AllFaults {
		if seen[f] == 0 {
			want[f] = true
			if n, ok := needs[f]; ok {
				want[n] = true
			}
		}
	}
	var out []Fault
	for _, f := range AllFaults {
		if want[f] {
			out = append(out, f)
		}
	}
	return out
}

// TestChaosCatchesBrokenEngine runs the engine in its deliberately broken
// mode (writes acknowledged before every replica has them) and checks that
// the linearizability checker finds the lost acknowledged writes, with a
// seed to replay them. Only that verdict counts as caught: a schedule that
// never ran (a setup failure, such as an unsafe engine that did not start)
// fails the test, and other problems (a heal that timed out, replicas that
// differ) are shown but are not what this test looks for.
func TestChaosCatchesBrokenEngine(t *testing.T) {
	needRoot(t)
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano() % 1e9)
	}
	for i := range 10 {
		cfg := config(t, seed+uint64(i))
		cfg.UnsafeEngine = true
		cfg.Faults = []Fault{FaultPauseReplica, FaultKillReplica, FaultRejoinReplica}
		r := Run(context.Background(), cfg)
		fmt.Println("broken engine:", r.Line())
		if r.Setup != nil {
			t.Fatal(brokenEngineSetupFailure(r, cfg.Bin))
		}
		if r.Linearizability == porcupine.Illegal {
			fmt.Printf("  caught; replay with: %s\n", replay(cfg))
			if r.Explanation != "" {
				fmt.Print("  " + r.Explanation)
			}
			if r.Dir != "" {
				os.RemoveAll(r.Dir)
			}
			return
		}
		if len(r.Problems) > 0 {
			fmt.Printf("  not a linearizability violation, not counted; logs of every process: %s\n", r.Dir)
		}
	}
	t.Fatal("the linearizability checker did not catch an engine that acknowledges writes early in 10 schedules")
}

// brokenEngineSetupFailure says why a schedule of the broken engine never
// ran, naming the cause where it is known.
func brokenEngineSetupFailure(r Result, bin string) string {
	if !errors.Is(r.Setup, errEngineStart) {
		return fmt.Sprintf("setup failed, so nothing was checked (this is no caught violation): %v; logs: %s", r.Setup, r.Dir)
	}
	tagged, err := builtWithTag(bin, "cairn_unsafe")
	switch {
	case err != nil:
		return fmt.Sprintf("the unsafe engine did not start: build cairn-data with -tags cairn_unsafe (could not read %s's build tags: %v): %v; logs: %s", bin, err, r.Setup, r.Dir)
	case !tagged:
		return fmt.Sprintf("the unsafe engine did not start: build cairn-data with -tags cairn_unsafe (%s was built without it): %v; logs: %s", bin, r.Setup, r.Dir)
	default:
		return fmt.Sprintf("the unsafe engine did not start, although %s has -tags cairn_unsafe: %v; logs: %s", bin, r.Setup, r.Dir)
	}
}

// builtWithTag reports whether the Go binary bin was built with the build
// tag (go build -tags), from the build information Go records in it.
func builtWithTag(bin, tag string) (bool, error) {
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		return false, err
	}
	for _, s := range info.Settings {
		if s.Key == "-tags" && slices.Contains(strings.Split(s.Value, ","), tag) {
			return true, nil
		}
	}
	return false, nil
}
