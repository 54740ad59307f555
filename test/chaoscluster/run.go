//go:build chaoscluster

package chaoscluster

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Config describes one schedule.
type Config struct {
	Seed   uint64
	Steps  int     // faults per schedule
	Faults []Fault // the kinds drawn from; AllFaults when empty
	Images images
}

// Result is what one schedule did and found.
type Result struct {
	Seed     uint64
	Schedule []Step
	// Done is one line per fault injected: its target and how long the
	// volumes took to be healthy again.
	Done     []string
	Summary  []string // what the workloads did
	Problems []string // violations; empty means the schedule held
	// Setup is why the schedule never ran its faults (nothing checked).
	Setup   error
	Elapsed time.Duration
}

// Line is the one-line summary of a schedule.
func (r Result) Line() string {
	var fs []string
	for _, s := range r.Schedule {
		fs = append(fs, string(s.Fault))
	}
	verdict := "ok"
	if len(r.Problems) > 0 {
		verdict = "VIOLATION: " + strings.Join(r.Problems, "; ")
	}
	return fmt.Sprintf("seed=%d faults[%s] %s %s", r.Seed, strings.Join(fs, " "), r.Elapsed.Round(time.Second), verdict)
}

// runner runs one schedule.
type runner struct {
	c         *cluster
	cfg       Config
	appNode   string
	workloads []*workload
	images    images
	heals     heals
}

// cleanupTimeout bounds healing, checking and deleting after the faults,
// which run on a fresh context so that an interrupt still cleans up.
const cleanupTimeout = 20 * time.Minute

// Run runs one schedule on the cluster: workloads up, the faults drawn
// from the seed one after another, then the checks, then everything the
// schedule created deleted. Whatever happens (a failed check, an
// interrupt), held faults are healed: stopped nodes started, cuts mended,
// ballast removed.
func Run(ctx context.Context, c *cluster, cfg Config) (res Result) {
	start := time.Now()
	res = Result{Seed: cfg.Seed, Schedule: Draw(cfg.Seed, cfg.Steps, cfg.Faults)}
	defer func() { res.Elapsed = time.Since(start) }()
	r := &runner{c: c, cfg: cfg, appNode: c.controlPlane, images: cfg.Images}
	tag := fmt.Sprintf("chaos-%d", cfg.Seed%1000000)
	r.workloads = []*workload{
		{name: tag + "-w0", kind: kindWriter, node: r.appNode},
		{name: tag + "-w1", kind: kindWriter, node: r.appNode},
		{name: tag + "-fio", kind: kindFio, node: r.appNode},
	}
	for i, s := range res.Schedule {
		c.logf("seed %d step %d: %s", cfg.Seed, i+1, s)
	}
	clean, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	defer func() {
		if err := r.heals.healAll(clean); err != nil {
			res.Problems = append(res.Problems, "healing: "+err.Error())
		}
		dirs, err := r.deleteWorkloads(clean)
		if err != nil {
			res.Problems = append(res.Problems, "cleanup: "+err.Error())
		}
		if res.Setup == nil {
			for _, o := range r.orphans(clean, dirs) {
				res.Problems = append(res.Problems, "orphan: "+o)
			}
		}
	}()
	if err := r.startWorkloads(ctx); err != nil {
		res.Setup = err
		res.Problems = append(res.Problems, "setup: "+err.Error())
		return res
	}
	c.logf("seed %d: workloads running on %s, volumes healthy", cfg.Seed, r.appNode)
	for i, s := range res.Schedule {
		if ctx.Err() != nil {
			c.logf("interrupted before step %d", i+1)
			break
		}
		line, err := r.step(ctx, i, s)
		res.Done = append(res.Done, line)
		if err != nil {
			res.Problems = append(res.Problems, fmt.Sprintf("step %d (%s): %v", i+1, line, err))
			break
		}
	}
	res.Problems = append(res.Problems, r.check(clean, &res)...)
	return res
}

// step injects one fault, holds and heals it if it is held, and (unless
// the step overlaps the next) waits until every volume is healthy and
// every workload does new work, within the bounds.
func (r *runner) step(ctx context.Context, i int, s Step) (string, error) {
	c := r.c
	sleep(ctx, s.Gap)
	injecting := time.Now()
	target, err := r.inject(ctx, s)
	line := fmt.Sprintf("%s %s", s.Fault, target)
	// Logged once the injection returned: a rolling restart's injection
	// is the whole roll, so its time is part of the line.
	c.logf("step %d: %s (injected in %s)", i+1, line, time.Since(injecting).Round(time.Second))
	if err != nil {
		return line, fmt.Errorf("injecting: %w", err)
	}
	if s.Fault.held() {
		sleep(ctx, s.Hold)
		healing := time.Now()
		if err := r.heals.healAll(ctx); err != nil {
			return line, fmt.Errorf("healing: %w", err)
		}
		line += fmt.Sprintf(" (held %s, healed in %s)", s.Hold, time.Since(healing).Round(time.Second))
	}
	if ctx.Err() != nil {
		return line + " (interrupted)", nil // check() waits for the volumes
	}
	if s.Overlap {
		return line + ", next step at once", nil
	}
	ended := time.Now()
	took, err := r.waitHealthy(ctx, healthyBound)
	if err != nil {
		return line, fmt.Errorf("volumes not healthy within %s: %w", healthyBound, err)
	}
	if err := r.waitProgress(ctx, progressBound); err != nil {
		return line, fmt.Errorf("a volume is stuck: %w", err)
	}
	// A Volume's status may not show the fault yet when it is first read,
	// so the second figure (each workload did new work since) is the one
	// that says the volumes serve again.
	line += fmt.Sprintf(", volumes read healthy %s and every workload did new work %s after it ended",
		took.Round(time.Second), time.Since(ended).Round(time.Second))
	c.logf("step %d: %s", i+1, line)
	return line, nil
}

// check runs after the faults: every held fault healed, every volume
// healthy and serving within the bounds, then each workload stopped and
// its data verified.
func (r *runner) check(ctx context.Context, res *Result) []string {
	var problems []string
	if err := r.heals.healAll(ctx); err != nil {
		problems = append(problems, "healing: "+err.Error())
	}
	if _, err := r.waitHealthy(ctx, healthyBound); err != nil {
		problems = append(problems, fmt.Sprintf("volumes not healthy within %s after the last fault: %v", healthyBound, err))
	} else if err := r.waitProgress(ctx, progressBound); err != nil {
		problems = append(problems, "a volume is stuck: "+err.Error())
	}
	for _, w := range r.workloads {
		p, summary := w.stopAndVerify(ctx, r.c)
		problems = append(problems, p...)
		if summary != "" {
			res.Summary = append(res.Summary, summary)
			r.c.logf("%s", summary)
		}
	}
	return problems
}
