package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	replicav1 "github.com/cairn-io/cairn/dataplane/api/replica/v1"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// deadPort is a loopback port where a connect hangs as one to a dead
// host's address does (the SYN goes unanswered): a socket listening with
// a backlog of 0 that never accepts, its one queue slot taken.
type deadPort struct {
	addr     string
	fd       int
	filler   net.Conn
	freeOnce sync.Once
}

func newDeadPort(t *testing.T) *deadPort {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	d := &deadPort{addr: fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port), fd: fd}
	if d.filler, err = net.Dial("tcp", d.addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.free)
	if c, err := net.DialTimeout("tcp", d.addr, 300*time.Millisecond); err == nil {
		c.Close()
		t.Skip("this kernel answers connects beyond a listen backlog of 0: no way to make a dead address here")
	}
	return d
}

// free closes the socket, so a replica can listen on the port.
func (d *deadPort) free() {
	d.freeOnce.Do(func() {
		d.filler.Close()
		syscall.Close(d.fd)
	})
}

// freeAddr is a loopback address nothing listens on (connects are refused).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// engineArgs is an nbd engine's command line (socket only) over replicas.
func engineArgs(t *testing.T, replicas ...string) []string {
	args := []string{"engine", "--name", "vol", "--frontend", "nbd", "--nbd-socket", filepath.Join(t.TempDir(), "vol.sock"),
		"--nbd-kernel", "off", "--listen", "127.0.0.1:0", "--replica-timeout", "3s", "--connect-timeout", "3s"}
	for _, r := range replicas {
		args = append(args, "--replica", r)
	}
	return args
}

// failReplicasBut kills every replica of v but keep while its engine
// serves, waits until the engine has them ERR (its epoch, and the RW set
// recorded with it, then name keep alone), and stops the engine.
func failReplicasBut(t *testing.T, v *volume, keep int) {
	t.Helper()
	for i, p := range v.replicas {
		if i != keep {
			p.cmd.Process.Kill()
			<-p.exited
		}
	}
	until := deadline.After(60 * time.Second)
	for strings.Count(v.ctl(t, "replicas"), "ERR") != len(v.replicas)-1 {
		if time.Now().After(until) {
			t.Fatalf("the killed replicas are not ERR:\n%s", v.ctl(t, "replicas"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	v.engine.stopClean(t, "engine")
}

// modeIn is the mode `ctl replicas` (out) shows for the replica at addr.
func modeIn(out, addr string) string {
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[1] == addr {
			return f[0]
		}
	}
	return ""
}

// replicaID asks a replica process for its ID.
func replicaID(t *testing.T, p *proc) string {
	t.Helper()
	in, err := dialControl(t, p.control).Info(context.Background(), &replicav1.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return in.Id
}

// TestEngineStartsWithoutDeadReplicaAddresses: the volume was served
// from one replica after the two others failed; an engine then given
// that replica, an address where connects hang (a dead host's, as a
// replica's old pod IP) and a closed port reports ready well within the
// instance manager's start timeout, says in its log which address it
// waited for, and has the two ERR. (It used to connect to one replica
// after the other with no bound but the open's two minutes, logging
// nothing, and the instance manager killed it every minute.)
func TestEngineStartsWithoutDeadReplicaAddresses(t *testing.T) {
	v := volumeReplicas(t, 3, 0, "16Mi")
	v.engine = start(t, v.args...)
	failReplicasBut(t, v, 0)

	dead := newDeadPort(t).addr + "," + newDeadPort(t).addr
	closed := freeAddr(t) + "," + freeAddr(t)
	// Each attempt gets 8 s, well beyond the engine's 3 s interval
	// between waiting lines, so a line is logged before the attempts end
	// (at engineArgs' 3 s the two fell due together and the line was
	// logged or not by the luck of a select).
	args := append(engineArgs(t, v.addrs[0], dead, closed), "--connect-timeout", "8s")
	began := time.Now()
	e, rep := startReady(t, args...)
	if took := time.Since(began); took > deadline.Scale(time.Minute) {
		t.Fatalf("ready after %v, beyond the instance manager's start timeout (1m)", took)
	}
	if rep.Size != 16<<20 {
		t.Fatalf("report %+v", rep)
	}
	if !e.logged("still connecting to replicas") || !strings.Contains(e.stderr.String(), dead) {
		t.Fatalf("the log does not say it waited for %s:\n%s", dead, e.stderr.String())
	}
	v.engine = e
	out := v.ctl(t, "replicas")
	if modeIn(out, v.addrs[0]) != "RW" || modeIn(out, dead) != "ERR" || modeIn(out, closed) != "ERR" {
		t.Fatalf("replicas:\n%s", out)
	}
}

// readyStream starts cairn-data with args and --ready-fd 3 (a pipe, as
// the instance manager gives it) and returns the process, the waiting
// lines it writes there, and its report (or the error reading it) once
// it comes.
func readyStream(t *testing.T, args ...string) (*proc, <-chan string, <-chan error) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: command(append(args, "--ready-fd", "3")...), stderr: &syncBuffer{}, exited: make(chan struct{})}
	p.cmd.ExtraFiles = []*os.File{w}
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	go func() { p.waitErr = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() { p.cmd.Process.Kill(); <-p.exited })
	waits := make(chan string, 256)
	done := make(chan error, 1)
	go func() {
		defer r.Close()
		rep, err := ready.ReadProgress(r, func(msg string) {
			select {
			case waits <- msg:
			default:
			}
		})
		if err == nil {
			p.control = rep.Control
		}
		done <- err
	}()
	return p, waits, done
}

// TestEngineWaitsForReplicaWithNewestData: the volume was served from
// one replica alone, whose address is then dead; the two others answer,
// but their newest epoch names the missing one as RW, so it may hold
// writes they lack. The engine does not report ready: it tells the
// instance manager (waiting lines on its ready descriptor) and its log
// whom it waits for, and once the replica answers at that address it
// serves with that replica RW and the two stale ones ERR. (It used to
// serve the stale two.)
func TestEngineWaitsForReplicaWithNewestData(t *testing.T) {
	v := volumeReplicas(t, 3, 0, "16Mi")
	v.engine = start(t, v.args...)
	survivor := replicaID(t, v.replicas[2])
	failReplicasBut(t, v, 2)
	v.replicas[2].cmd.Process.Kill()
	<-v.replicas[2].exited
	var addrs []string
	for i := range 2 {
		p := start(t, "replica", "--dir", v.dirs[i], "--size", "16Mi", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0")
		addrs = append(addrs, p.data+","+p.control)
	}
	data, ctl := newDeadPort(t), newDeadPort(t)
	dead := data.addr + "," + ctl.addr
	e, waits, done := readyStream(t, engineArgs(t, addrs[0], addrs[1], dead)...)
	until := time.After(deadline.Scale(60 * time.Second))
	for seen := false; !seen; {
		select {
		case msg := <-waits:
			seen = strings.Contains(msg, dead) && strings.Contains(msg, survivor)
		case err := <-done:
			t.Fatalf("the engine reported ready (or exited: %v) while the replica with the newest data did not answer\n%s", err, e.stderr.String())
		case <-until:
			t.Fatalf("no waiting line naming %s and replica %s\n%s", dead, survivor, e.stderr.String())
		}
	}
	if !e.logged("cannot serve the volume yet") {
		t.Fatalf("the log does not say it waits:\n%s", e.stderr.String())
	}
	data.free()
	ctl.free()
	start(t, "replica", "--dir", v.dirs[2], "--size", "16Mi", "--listen", data.addr, "--control-listen", ctl.addr)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("ready report: %v\n%s", err, e.stderr.String())
		}
	case <-time.After(deadline.Scale(60 * time.Second)):
		t.Fatalf("no ready report once the replica answered\n%s", e.stderr.String())
	}
	v.engine = e
	out := v.ctl(t, "replicas")
	if modeIn(out, dead) != "RW" || modeIn(out, addrs[0]) != "ERR" || modeIn(out, addrs[1]) != "ERR" {
		t.Fatalf("replicas:\n%s", out)
	}
}

// TestInstanceManagerShowsWhatEngineWaitsFor: an engine that cannot
// serve yet (a fresh volume, one replica's address dead) is shown by the
// instance manager as starting with what it waits for, and when the
// start timeout kills it, its error says so too.
func TestInstanceManagerShowsWhatEngineWaitsFor(t *testing.T) {
	ctx := context.Background()
	im := startIM(t, freePortRange(t, 8), "--start-timeout", "20s")
	if _, err := im.c.ProcessCreate(ctx, replicaReq("ns/v-r-0", filepath.Join(im.dir, "r0"))); err != nil {
		t.Fatal(err)
	}
	r := waitState(t, im.c, "ns/v-r-0", imv1.ProcessState_PROCESS_STATE_RUNNING)
	data, ctl := newDeadPort(t), newDeadPort(t)
	_, err := im.c.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: "ns/v-e", Spec: &imv1.ProcessCreateRequest_Engine{Engine: &imv1.EngineSpec{
		VolumeName: "v", Frontend: imv1.Frontend_FRONTEND_NBD, NbdKernel: imv1.NBDKernel_NBD_KERNEL_OFF,
		Replicas: []*imv1.ReplicaAddress{{Data: r.DataAddress, Control: r.ControlAddress}, {Data: data.addr, Control: ctl.addr}}}}})
	if err != nil {
		t.Fatal(err)
	}
	until := deadline.After(60 * time.Second)
	for {
		p, err := im.c.ProcessGet(ctx, &imv1.ProcessGetRequest{Name: "ns/v-e"})
		if err == nil && p.State == imv1.ProcessState_PROCESS_STATE_STARTING && strings.Contains(p.Waiting, data.addr) {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the engine is not shown waiting for %s: %v %v", data.addr, p, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	p := waitState(t, im.c, "ns/v-e", imv1.ProcessState_PROCESS_STATE_ERROR)
	if !strings.Contains(p.Error, "did not report ready within 20s") || !strings.Contains(p.Error, "waiting for replica") || !strings.Contains(p.Error, data.addr) {
		t.Fatalf("error %q: want the timeout and what the engine waited for", p.Error)
	}
}
