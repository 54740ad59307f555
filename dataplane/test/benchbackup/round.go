package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"time"
)

// roundResult holds one round's measurements.
type roundResult struct {
	backup, backupControl, backupCRC, plainUp measure
	restore, plainDown                        measure
	incContiguous, incScattered               measure
}

func (r roundResult) summary() string {
	return fmt.Sprintf("backup %v (control API %v, CRC32C %v) plain upload %v restore %v plain download %v incremental contiguous %v scattered %v",
		r.backup.d.Round(time.Millisecond), r.backupControl.d.Round(time.Millisecond), r.backupCRC.d.Round(time.Millisecond),
		r.plainUp.d.Round(time.Millisecond), r.restore.d.Round(time.Millisecond),
		r.plainDown.d.Round(time.Millisecond), r.incContiguous.d.Round(time.Millisecond), r.incScattered.d.Round(time.Millisecond))
}

// round measures everything once, into a volume folder and object prefix
// of its own, and removes what it wrote to the target afterwards.
func (b *bench) round(r int) (roundResult, error) {
	var res roundResult
	vol := fmt.Sprintf("bench-%d", r)
	full := b.snap
	restored, plain := filepath.Join(b.work, "restore.img"), filepath.Join(b.work, "plain.img")
	type step struct {
		m  *measure
		fn func() (int64, int64, error)
	}
	uploads := []step{
		{&res.plainUp, func() (int64, int64, error) { return b.plainUpload(r) }},
		{&res.backup, func() (int64, int64, error) {
			return b.profiled(r, "backup", func() (int64, int64, error) { return b.backup(b.store, b.src, vol, "full", "", "") })
		}},
		// Into volume folders of their own: in the same one, every block
		// would be there already and nothing uploaded.
		{&res.backupControl, func() (int64, int64, error) {
			return b.backup(b.store, b.srcControl, vol+"-control", "full", "", "")
		}},
		{&res.backupCRC, func() (int64, int64, error) { return b.backup(b.storeCRC, b.src, vol+"-crc32c", "full", "", "") }},
	}
	downloads := []step{
		{&res.plainDown, func() (int64, int64, error) { return b.plainDownload(r, plain) }},
		{&res.restore, func() (int64, int64, error) {
			return b.profiled(r, "restore", func() (int64, int64, error) { return b.restore(vol, "full", restored) })
		}},
	}
	if r%2 == 0 { // alternate the order within each group
		slices.Reverse(uploads)
		slices.Reverse(downloads)
	}
	steps := append(uploads, downloads...)
	for _, s := range steps {
		m, err := b.timed(s.fn)
		if err != nil {
			return res, err
		}
		*s.m = m
	}
	for _, p := range []string{restored, plain} {
		if err := b.sameAsMirror(p); err != nil {
			return res, err
		}
		if err := os.Remove(p); err != nil {
			return res, err
		}
	}
	if err := b.incremental(&res, vol, full); err != nil {
		return res, err
	}
	return res, b.clean(vol, r)
}

// incremental changes 1 % contiguously and backs up on the full backup,
// then 1 % scattered and backs up on that.
func (b *bench) incremental(res *roundResult, vol, full string) error {
	base := full
	for _, inc := range []struct {
		m          *measure
		contiguous bool
		name, on   string
	}{{&res.incContiguous, true, "inc-contiguous", "full"}, {&res.incScattered, false, "inc-scattered", "inc-contiguous"}} {
		if err := b.change(inc.contiguous); err != nil {
			return err
		}
		m, err := b.timed(func() (int64, int64, error) { return b.backup(b.store, b.src, vol, inc.name, base, inc.on) })
		if err != nil {
			return err
		}
		*inc.m, base = m, b.snap
	}
	return nil
}

// profiled runs fn under the CPU profiler in round 1 when --cpuprofile is
// set, into PREFIX.what.pprof.
func (b *bench) profiled(r int, what string, fn func() (int64, int64, error)) (int64, int64, error) {
	if r != 1 || *cpuprofile == "" {
		return fn()
	}
	f, err := os.Create(*cpuprofile + "." + what + ".pprof")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return 0, 0, err
	}
	defer pprof.StopCPUProfile()
	return fn()
}

// clean removes the round's backups and plain objects from the server's
// directory (versitygw's posix backend keeps an object as a file at its
// key), so the disk holds one round's data at a time.
func (b *bench) clean(vol string, r int) error {
	var errs []error
	for _, v := range []string{vol, vol + "-control", vol + "-crc32c"} {
		errs = append(errs, os.RemoveAll(filepath.Join(b.s3root, "volumes", v)))
	}
	return errors.Join(append(errs, os.RemoveAll(filepath.Join(b.s3root, "plain", fmt.Sprint(r))))...)
}

const mib = float64(1 << 20)

func mibps(size int64, ms []measure) float64 {
	var xs []float64
	for _, m := range ms {
		xs = append(xs, float64(size)/mib/m.d.Seconds())
	}
	return sortedMedian(xs)
}

func medianOf(ms []measure, f func(measure) float64) float64 {
	var xs []float64
	for _, m := range ms {
		xs = append(xs, f(m))
	}
	return sortedMedian(xs)
}

func pick(all []roundResult, f func(roundResult) measure) []measure {
	var out []measure
	for _, r := range all {
		out = append(out, f(r))
	}
	return out
}

// cpuCols is the median CPU seconds per GiB moved of this process, the
// replica and versitygw.
func cpuCols(size int64, ms []measure) string {
	perGiB := float64(1<<30) / float64(size)
	c := func(f func(cpu) time.Duration) float64 {
		return medianOf(ms, func(m measure) float64 { return f(m.cpu).Seconds() * perGiB })
	}
	return fmt.Sprintf("%5.1f / %5.1f / %5.1f", c(func(x cpu) time.Duration { return x.self }),
		c(func(x cpu) time.Duration { return x.replica }), c(func(x cpu) time.Duration { return x.s3 }))
}

// roundRatios lists each round's throughput ratio (the plain time over
// Cairn's, both measured in that round) and their median: on a machine
// whose load changes between rounds, the pairs are the fairer comparison.
func roundRatios(cairn, plain []measure) string {
	var out []string
	var xs []float64
	for i := range cairn {
		x := plain[i].d.Seconds() / cairn[i].d.Seconds()
		xs = append(xs, x)
		out = append(out, fmt.Sprintf("%.2f", x))
	}
	return fmt.Sprintf("%s (median %.2f)", strings.Join(out, " "), sortedMedian(xs))
}

func printTable(w io.Writer, size int64, all []roundResult) {
	fmt.Fprintf(w, "\nBackups of %s of random data (%d MiB), versitygw on 127.0.0.1, medians of %d interleaved rounds\n",
		*sizeFlag, size>>20, len(all))
	fmt.Fprintf(w, "(store: %d MiB blocks, 4 at once; plain: minio-go PutObject/GetObject of %d MiB objects, 4 at once)\n\n", blockSize>>20, blockSize>>20)
	fmt.Fprintf(w, "%-34s %10s %10s %7s %6s   %s\n", "", "cairn", "plain S3", "ratio", "goal", "CPU s/GiB cairn: bench / replica / versitygw; plain: bench / - / versitygw")
	row := func(name string, cairn, plain []measure) {
		c, p := mibps(size, cairn), mibps(size, plain)
		fmt.Fprintf(w, "%-34s %10.1f %10.1f %6.2fx %6s   %s; %s; ratio by round: %s\n", name, c, p, c/p, "0.80x",
			cpuCols(size, cairn), cpuCols(size, plain), roundRatios(cairn, plain))
	}
	row("backup, full (MiB/s)", pick(all, func(r roundResult) measure { return r.backup }), pick(all, func(r roundResult) measure { return r.plainUp }))
	row("  reading over the control API", pick(all, func(r roundResult) measure { return r.backupControl }), pick(all, func(r roundResult) measure { return r.plainUp }))
	row("  with CRC32C puts, not Content-MD5", pick(all, func(r roundResult) measure { return r.backupCRC }), pick(all, func(r roundResult) measure { return r.plainUp }))
	row("restore into a new file (MiB/s)", pick(all, func(r roundResult) measure { return r.restore }), pick(all, func(r roundResult) measure { return r.plainDown }))
	full := medianOf(pick(all, func(r roundResult) measure { return r.backup }), func(m measure) float64 { return m.d.Seconds() })
	fmt.Fprintf(w, "\n%-34s %9s %12s %10s %10s   %s\n", "incremental after changing 1 %", "time s", "of full's", "read MiB", "put MiB", "CPU s: bench / replica / versitygw")
	for _, inc := range []struct {
		name string
		f    func(roundResult) measure
	}{{"one contiguous range", func(r roundResult) measure { return r.incContiguous }},
		{"4 KiB writes at random offsets", func(r roundResult) measure { return r.incScattered }}} {
		ms := pick(all, inc.f)
		d := medianOf(ms, func(m measure) float64 { return m.d.Seconds() })
		fmt.Fprintf(w, "%-34s %9.2f %11.1f%% %10.1f %10.1f   %s\n", inc.name, d, 100*d/full,
			medianOf(ms, func(m measure) float64 { return float64(m.read) / mib }),
			medianOf(ms, func(m measure) float64 { return float64(m.put) / mib }),
			strings.TrimSpace(cpuCols(1<<30, ms)))
	}
	fmt.Fprintf(w, "(full backup: %.2f s median)\n", full)
}
