package backupstore

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// gatedSource reads from a real file but blocks its read number stopAt
// (counting from 1) until release is closed, closing reached first.
type gatedSource struct {
	io.ReaderAt
	stopAt  int
	mu      sync.Mutex
	reads   int
	reached chan struct{}
	release chan struct{}
}

func newGatedSource(r io.ReaderAt, stopAt int) *gatedSource {
	return &gatedSource{ReaderAt: r, stopAt: stopAt, reached: make(chan struct{}), release: make(chan struct{})}
}

func (g *gatedSource) ReadAt(p []byte, off int64) (int, error) {
	g.mu.Lock()
	g.reads++
	stop := g.reads == g.stopAt
	g.mu.Unlock()
	if stop {
		close(g.reached)
		<-g.release
	}
	return g.ReaderAt.ReadAt(p, off)
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(deadline.Scale(2 * time.Minute)):
		t.Fatalf("timed out waiting for %s", what)
	}
}

func manifestHashes(t *testing.T, s *Store, name string) map[Hash]bool {
	t.Helper()
	m, err := s.Manifest(testCtx(t), testVol, name)
	if err != nil {
		t.Fatal(err)
	}
	hs := map[Hash]bool{}
	for _, b := range m.Blocks {
		hs[b.Hash] = true
	}
	return hs
}

func blockHashes(t *testing.T, tg Target) map[Hash]bool {
	hs := map[Hash]bool{}
	for key := range blockObjects(t, tg) {
		h, ok := parseHash(key[strings.LastIndex(key, "/")+1:])
		if !ok {
			t.Fatalf("block object %s is not named by a hash", key)
		}
		hs[h] = true
	}
	return hs
}

// waitClockPastBlocks waits until the target's clock reads later than
// the newest block's write time. Collection keeps a block written at or
// after its cutoff (the target's now minus GCMinAge); an S3 server's
// Last-Modified has whole seconds, so with GCMinAge 0 a block written in
// the collection's second is still young.
func waitClockPastBlocks(t *testing.T, tg Target) {
	t.Helper()
	var newest time.Time
	for _, o := range blockObjects(t, tg) {
		if o.ModTime.After(newest) {
			newest = o.ModTime
		}
	}
	const probe = "clock-probe"
	defer func() { _ = tg.Delete(testCtx(t), probe) }()
	for until := deadline.After(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if err := tg.Put(testCtx(t), probe, []byte{1}); err != nil {
			t.Fatal(err)
		}
		if o, ok := listKeys(t, tg, probe)[probe]; ok && o.ModTime.After(newest) {
			return
		}
		if time.Now().After(until) {
			t.Fatalf("the target's clock did not pass %v, its newest block's write time", newest)
		}
	}
}

// TestGC: after deleting the first of two backups, garbage collection
// keeps every block the second needs and removes the rest; while a backup
// is in progress it removes nothing (ErrBusy), and once that backup is
// done its blocks survive the next collection.
func TestGC(t *testing.T) {
	for _, k := range targetKinds() {
		t.Run(k.name, func(t *testing.T) {
			tg, _ := k.new(t)
			s := newStore(t, tg, testOptions(t))
			img := newImage(t)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "a", Source: img.f, Size: imageSize}); err != nil {
				t.Fatal(err)
			}
			changed := []Range{{Offset: 0, Length: 3 << 20}, {Offset: 20 << 20, Length: 1 << 20}}
			img.random(t, 0, 3<<20)
			img.random(t, 20<<20, 1<<20)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b", Parent: "a", Source: img.f, Size: imageSize, Changed: changed}); err != nil {
				t.Fatal(err)
			}
			atB := img.snapshot()
			hashesA, hashesB := manifestHashes(t, s, "a"), manifestHashes(t, s, "b")
			onlyA := 0
			for h := range hashesA {
				if !hashesB[h] {
					onlyA++
				}
			}
			if onlyA == 0 {
				t.Fatal("test setup: backup a has no block of its own")
			}
			if err := s.Delete(testCtx(t), testVol, "a"); err != nil {
				t.Fatal(err)
			}

			// Backup c is in progress: it has uploaded two new blocks and
			// is stuck reading its third.
			img.random(t, 4<<20, 8<<20)
			src := newGatedSource(img.f, 3)
			sc := newStore(t, tg, func() Options { o := testOptions(t); o.Concurrency = 1; return o }())
			cDone := make(chan error, 1)
			go func() {
				_, err := sc.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "c", Parent: "b", Source: src, Size: imageSize,
					Changed: []Range{{Offset: 4 << 20, Length: 8 << 20}}})
				cDone <- err
			}()
			waitClosed(t, src.reached, "backup c to read its third block")
			stored := blockHashes(t, tg)
			if len(stored) != len(hashesA)+len(hashesB)-(len(hashesA)-onlyA)+2 {
				t.Fatalf("%d blocks stored while c runs; want a's and b's (%d distinct) and c's 2", len(stored), len(hashesB)+onlyA)
			}
			if _, err := s.CollectGarbage(testCtx(t), testVol); !errors.Is(err, ErrBusy) {
				t.Fatalf("collection during backup c: %v, want ErrBusy", err)
			}
			if got := blockHashes(t, tg); len(got) != len(stored) {
				t.Fatalf("collection during backup c removed blocks: %d of %d left", len(got), len(stored))
			}
			close(src.release)
			if err := <-cDone; err != nil {
				t.Fatalf("backup c: %v", err)
			}
			atC := img.snapshot()

			waitClockPastBlocks(t, tg)
			res, err := s.CollectGarbage(testCtx(t), testVol)
			if err != nil {
				t.Fatal(err)
			}
			if res.Deleted != onlyA {
				t.Errorf("collection deleted %d blocks, want a's own %d", res.Deleted, onlyA)
			}
			want := manifestHashes(t, s, "b")
			for h := range manifestHashes(t, s, "c") {
				want[h] = true
			}
			got := blockHashes(t, tg)
			if len(got) != len(want) {
				t.Errorf("%d blocks left, want the %d that b and c reference", len(got), len(want))
			}
			for h := range want {
				if !got[h] {
					t.Errorf("block %s, referenced, was deleted", h)
				}
			}
			restoreAndCompare(t, s, "b", atB, false)
			restoreAndCompare(t, s, "c", atC, false)
		})
	}
}

// childEnv carries a killed-backup child's instructions.
const childEnv = "CAIRN_BACKUPSTORE_CHILD"

type childSpec struct {
	Target        childTarget
	Image, Marker string
	Size          int64
	LeaseDuration time.Duration
	CallTimeout   time.Duration
}

func killTestOptions(t *testing.T) Options {
	o := testOptions(t)
	o.LeaseDuration = deadline.Scale(8 * time.Second)
	o.CallTimeout = o.LeaseDuration / 4
	return o
}

// TestKilledBackup: a backup process killed (SIGKILL) after uploading some
// blocks, before its manifest, leaves no backup: it is not listed, cannot
// be restored or used as a parent; garbage collection waits for its lease
// to expire and then removes its blocks, keeping the complete backup's.
func TestKilledBackup(t *testing.T) {
	for _, k := range targetKinds() {
		t.Run(k.name, func(t *testing.T) {
			tg, child := k.new(t)
			opts := killTestOptions(t)
			s := newStore(t, tg, opts)
			img := newImage(t)
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b1", Source: img.f, Size: imageSize}); err != nil {
				t.Fatal(err)
			}
			b1Blocks := blockHashes(t, tg)

			// The child backs up 16 MiB of new random bytes as b2 and is
			// killed while stuck on its third block.
			img.random(t, 0, 16<<20)
			dir := t.TempDir()
			spec := childSpec{Target: child, Image: img.f.Name(), Marker: filepath.Join(dir, "reached"), Size: 16 << 20,
				LeaseDuration: opts.LeaseDuration, CallTimeout: opts.CallTimeout}
			specJSON, _ := json.Marshal(spec)
			cmd := exec.Command(os.Args[0], "-test.run=^TestKilledBackupChild$", "-test.v")
			cmd.Env = append(os.Environ(), childEnv+"="+string(specJSON))
			out, _ := os.Create(filepath.Join(dir, "child.log"))
			cmd.Stdout, cmd.Stderr = out, out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			for until := deadline.After(2 * time.Minute); ; time.Sleep(20 * time.Millisecond) {
				if _, err := os.Stat(spec.Marker); err == nil {
					break
				}
				if time.Now().After(until) {
					log, _ := os.ReadFile(out.Name())
					t.Fatalf("the child did not reach its third block:\n%s", log)
				}
			}
			_ = cmd.Process.Signal(syscall.SIGKILL)
			_ = cmd.Wait()

			list, err := s.List(testCtx(t), testVol)
			if err != nil || len(list) != 1 || list[0].Name != "b1" {
				t.Errorf("List after the kill = %+v, %v; want only b1", list, err)
			}
			if _, err := s.Restore(testCtx(t), RestoreOptions{Volume: testVol, Name: "b2", Dest: discard{}}); !errors.Is(err, ErrBackupNotFound) {
				t.Errorf("restore of the killed backup: %v, want ErrBackupNotFound", err)
			}
			if _, err := s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b3", Parent: "b2", Source: img.f, Size: imageSize}); !errors.Is(err, ErrBackupNotFound) {
				t.Errorf("backup on the killed backup as parent: %v, want ErrBackupNotFound", err)
			}
			if got := len(blockHashes(t, tg)); got != len(b1Blocks)+2 {
				t.Fatalf("%d blocks after the kill, want b1's %d and the child's 2", got, len(b1Blocks))
			}
			if _, err := s.CollectGarbage(testCtx(t), testVol); !errors.Is(err, ErrBusy) {
				t.Fatalf("collection while the killed backup's lease is live: %v, want ErrBusy", err)
			}
			var res *GCResult
			for until := deadline.After(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
				res, err = s.CollectGarbage(testCtx(t), testVol)
				if !errors.Is(err, ErrBusy) {
					break
				}
				if time.Now().After(until) {
					t.Fatalf("the killed backup's lease did not expire: %v", err)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Deleted != 2 || res.ExpiredLeases != 1 {
				t.Errorf("collection after the lease expired: %+v, want 2 blocks and 1 lease deleted", res)
			}
			if got := blockHashes(t, tg); len(got) != len(b1Blocks) {
				t.Errorf("%d blocks left, want b1's %d", len(got), len(b1Blocks))
			}
			if len(listKeys(t, tg, leasePrefix(testVol))) != 0 {
				t.Errorf("leases left: %v", listKeys(t, tg, leasePrefix(testVol)))
			}
		})
	}
}

// TestKilledBackupChild is the process TestKilledBackup kills; it does
// nothing in a normal run.
func TestKilledBackupChild(t *testing.T) {
	raw := os.Getenv(childEnv)
	if raw == "" {
		t.Skip("run by TestKilledBackup")
	}
	var spec childSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	tg, err := spec.Target.open()
	if err != nil {
		t.Fatal(err)
	}
	opts := testOptions(t)
	opts.LeaseDuration, opts.CallTimeout, opts.Concurrency = spec.LeaseDuration, spec.CallTimeout, 1
	s := newStore(t, tg, opts)
	f, err := os.Open(spec.Image)
	if err != nil {
		t.Fatal(err)
	}
	src := newGatedSource(f, 3)
	go func() {
		<-src.reached
		_ = os.WriteFile(spec.Marker, nil, 0o644)
	}()
	_, err = s.Backup(testCtx(t), BackupOptions{Volume: testVol, Name: "b2", Source: src, Size: spec.Size})
	t.Fatalf("the backup was to be killed, but returned: %v", err)
}
