package main

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// watcher receives an engine's Watch stream in the background.
type watcher struct {
	t    *testing.T
	msgs chan *enginev1.VolumeStatus
	errs chan error
	last uint64 // the seq of the last message taken
}

func watchEngine(t *testing.T, control string) *watcher {
	t.Helper()
	cc, err := grpc.NewClient(control, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); cc.Close() })
	stream, err := enginev1.NewEngineServiceClient(cc).Watch(ctx, &enginev1.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	w := &watcher{t: t, msgs: make(chan *enginev1.VolumeStatus, 1000), errs: make(chan error, 1)}
	go func() {
		for {
			st, err := stream.Recv()
			if err != nil {
				w.errs <- err
				return
			}
			w.msgs <- st
		}
	}()
	return w
}

// next takes messages until one satisfies ok, failing after d (scaled
// by the suite's deadline factor).
func (w *watcher) next(d time.Duration, what string, ok func(*enginev1.VolumeStatus) bool) *enginev1.VolumeStatus {
	w.t.Helper()
	d = deadline.Scale(d)
	until := time.After(d)
	for {
		select {
		case st := <-w.msgs:
			if st.Seq <= w.last {
				w.t.Fatalf("seq %d after %d", st.Seq, w.last)
			}
			w.last = st.Seq
			w.t.Logf("watch: %s", statusLine(st))
			if ok(st) {
				return st
			}
		case err := <-w.errs:
			w.t.Fatalf("the watch stream ended waiting for %s: %v", what, err)
		case <-until:
			w.t.Fatalf("no message with %s in %v", what, d)
		}
	}
}

// quiet counts the messages that arrive in d.
func (w *watcher) quiet(d time.Duration) int {
	w.t.Helper()
	n := 0
	until := time.After(d)
	for {
		select {
		case st := <-w.msgs:
			w.t.Logf("watch while idle: %s", statusLine(st))
			w.last = st.Seq
			n++
		case err := <-w.errs:
			w.t.Fatalf("the watch stream ended: %v", err)
		case <-until:
			return n
		}
	}
}

func modeOf(st *enginev1.VolumeStatus, addr string) string {
	for _, r := range st.Replicas {
		if r.Address == addr {
			return r.Mode
		}
	}
	return ""
}

func hasSnapshot(st *enginev1.VolumeStatus, name string) bool {
	return slices.ContainsFunc(st.Snapshots, func(s *enginev1.Snapshot) bool { return s.Name == name && s.UserCreated })
}

// TestEngineWatch: an engine's Watch stream sends the whole status at
// once, then a message for each change (a killed replica turning ERR, a
// snapshot, an expansion, a rebuild's progress to its end) and none while
// nothing changes; several watchers see the same seq.
func TestEngineWatch(t *testing.T) {
	needTool(t, "qemu-io")
	v := startVolume(t, 3, "32Mi")
	qemuIO(t, v.uri, "write -P 0x5a 0 16M", "flush") // for the rebuild to copy
	w := watchEngine(t, v.engine.control)
	first := w.next(10*time.Second, "the first status", func(*enginev1.VolumeStatus) bool { return true })
	if first.Name != "vol" || first.Size != 32<<20 || first.Robustness != "healthy" || len(first.Replicas) != 3 ||
		first.Endpoint != v.sock || first.EndpointKind != "nbd-socket" || len(first.Snapshots) != 0 || first.Epoch == 0 ||
		first.GetActualSize() != 16<<20 {
		t.Fatalf("first status: %v", first)
	}
	for _, r := range first.Replicas {
		if r.Mode != "RW" {
			t.Fatalf("first status: %v", first)
		}
	}
	// Nothing changes: nothing is sent (several sampling periods).
	if n := w.quiet(time.Second); n != 0 {
		t.Fatalf("%d messages while the volume was idle", n)
	}

	// A replica dies: the engine finds it at its next ping (2 s) and the
	// watcher hears of it.
	v.replicas[1].cmd.Process.Kill()
	v.replicas[1].waitExit(t)
	w.next(15*time.Second, v.addrs[1]+" ERR", func(st *enginev1.VolumeStatus) bool {
		return modeOf(st, v.addrs[1]) == "ERR" && st.Robustness == "degraded"
	})

	v.ctl(t, "snapshot", "create", "s1")
	w.next(5*time.Second, "snapshot s1", func(st *enginev1.VolumeStatus) bool { return hasSnapshot(st, "s1") })
	// The actual size counts the head and every snapshot; a snapshot call
	// has it sampled at once (not at the next 10 s sample).
	qemuIO(t, v.uri, "write -P 0x6b 20M 4M", "flush")
	v.ctl(t, "snapshot", "create", "s2")
	w.next(5*time.Second, "snapshot s2 and actual size 20Mi", func(st *enginev1.VolumeStatus) bool {
		return hasSnapshot(st, "s2") && st.GetActualSize() == 20<<20
	})
	v.ctl(t, "expand", "64Mi")
	w.next(5*time.Second, "size 64Mi", func(st *enginev1.VolumeStatus) bool { return st.Size == 64<<20 })

	// A second watcher starts with the status as it is, numbered as the
	// first watcher's.
	w2 := watchEngine(t, v.engine.control)
	if st2 := w2.next(10*time.Second, "the first status", func(*enginev1.VolumeStatus) bool { return true }); st2.Seq < w.last || st2.Size != 64<<20 || !hasSnapshot(st2, "s1") {
		t.Fatalf("second watcher's first status (seq %d, first watcher at %d): %v", st2.Seq, w.last, st2)
	}

	// A fresh replica added is rebuilt: the rebuild shows up and ends
	// complete with the replica RW.
	fresh := start(t, "replica", "--dir", filepath.Join(t.TempDir(), "new"), "--size", "64Mi",
		"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
	addr := fresh.data + "," + fresh.control
	if out := v.ctl(t, "add", addr, "--wait"); !strings.Contains(out, "complete 100%") {
		t.Fatalf("add --wait:\n%s", out)
	}
	w.next(5*time.Second, "the rebuild of "+addr+" complete", func(st *enginev1.VolumeStatus) bool {
		return modeOf(st, addr) == "RW" && slices.ContainsFunc(st.Rebuilds, func(r *enginev1.Rebuild) bool {
			return r.Replica == addr && r.State == "complete" && r.BytesTotal >= 16<<20 && r.BytesDone == r.BytesTotal
		})
	})
	v.ctl(t, "snapshot", "delete", "s1")
	w.next(5*time.Second, "snapshot s1 gone", func(st *enginev1.VolumeStatus) bool { return !hasSnapshot(st, "s1") })
	if n := w.quiet(time.Second); n != 0 {
		t.Fatalf("%d messages while the volume was idle", n)
	}
}
