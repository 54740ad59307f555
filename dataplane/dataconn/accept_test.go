package dataconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// flakyListener is a real listener whose Accept first fails fails times
// with err, as accept4 would (wrapped in *net.OpError and
// *os.SyscallError); fails < 0 fails forever. It records when Accept was
// called.
type flakyListener struct {
	net.Listener
	err error

	mu    sync.Mutex
	fails int
	calls []time.Time
}

func (l *flakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	l.calls = append(l.calls, time.Now())
	if l.fails != 0 {
		l.fails--
		l.mu.Unlock()
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.Addr(), Err: os.NewSyscallError("accept4", l.err)}
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

func (l *flakyListener) callTimes() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Time(nil), l.calls...)
}

// logLines is a logger that keeps what it is given.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (ll *logLines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		ll.mu.Lock()
		defer ll.mu.Unlock()
		ll.lines = append(ll.lines, args)
	}, funcr.Options{})
}

// count returns how many lines contain s.
func (ll *logLines) count(s string) int {
	ll.mu.Lock()
	defer ll.mu.Unlock()
	n := 0
	for _, l := range ll.lines {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

func flaky(t *testing.T, fails int, err error) *flakyListener {
	t.Helper()
	l, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	t.Cleanup(func() { l.Close() })
	return &flakyListener{Listener: l, fails: fails, err: err}
}

// TestServeRidesOutTransientAcceptErrors: a process out of descriptors
// (EMFILE, ENFILE) fails accept for a while; Serve waits it out with a
// growing back-off, reports it once rather than per retry, and then
// serves the connection that was waiting.
func TestServeRidesOutTransientAcceptErrors(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE} {
		t.Run(errno.Error(), func(t *testing.T) {
			const fails = 4
			l := flaky(t, fails, errno)
			var logs logLines
			srv := NewServer(newMem(1<<20), ServerOptions{Logger: logs.logger()})
			served := make(chan error, 1)
			go func() { served <- srv.Serve(l) }()
			cl, err := Dial(context.Background(), "tcp", l.Addr().String(), ClientOptions{Conns: 1, PingInterval: -1, RequestTimeout: deadline.Scale(10 * time.Second)})
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			pinged := make(chan error, 1)
			go func() { pinged <- cl.WriteAt(context.Background(), []byte("still here"), 0, false) }()
			select {
			case err := <-served:
				t.Fatalf("Serve returned on %v: %v", errno, err)
			case err := <-pinged:
				if err != nil {
					t.Fatalf("a write after %d failed accepts: %v", fails, err)
				}
			}
			calls := l.callTimes()
			if len(calls) < fails+1 {
				t.Fatalf("Accept called %d times, want at least %d", len(calls), fails+1)
			}
			for i := range fails {
				if gap, want := calls[i+1].Sub(calls[i]), 5*time.Millisecond<<i; gap < want {
					t.Errorf("retry %d came %s after the failure, want at least %s (doubling back-off)", i+1, gap, want)
				}
			}
			if n, m := logs.count("accepting connections fails"), logs.count("accepting connections again"); n != 1 || m != 1 {
				t.Errorf("logged %d failure and %d recovery reports for %d failures, want one each:\n%s", n, m, fails, strings.Join(logs.lines, "\n"))
			}
			if err := srv.Close(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-served:
				if !errors.Is(err, ErrServerClosed) {
					t.Fatalf("Serve after Close: %v", err)
				}
			case <-time.After(deadline.Scale(10 * time.Second)):
				t.Fatal("Serve did not return after Close")
			}
		})
	}
}

// TestServeStopsOnCloseOrPermanentAcceptError: Close ends a back-off at
// once (Serve returns ErrServerClosed, not the transient error), and an
// error that will not pass ends Serve with that error.
func TestServeStopsOnCloseOrPermanentAcceptError(t *testing.T) {
	l := flaky(t, -1, syscall.EMFILE)
	srv := NewServer(newMem(1<<20), ServerOptions{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	// Let it fail a few times, so that Close comes during a back-off.
	for until := deadline.After(10 * time.Second); len(l.callTimes()) < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(until) {
			t.Fatal("Serve did not retry")
		}
		select {
		case err := <-served:
			t.Fatalf("Serve returned on EMFILE: %v", err)
		default:
		}
	}
	srv.Close()
	select {
	case err := <-served:
		if !errors.Is(err, ErrServerClosed) {
			t.Fatalf("Serve after Close: %v, want ErrServerClosed", err)
		}
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Serve did not return after Close")
	}

	l = flaky(t, 1, syscall.EINVAL) // the socket is not listening: permanent
	srv = NewServer(newMem(1<<20), ServerOptions{})
	defer srv.Close()
	go func() { served <- srv.Serve(l) }()
	select {
	case err := <-served:
		if !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("Serve on EINVAL: %v", err)
		}
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Serve did not return on a permanent accept error")
	}
}

func TestTransientAcceptError(t *testing.T) {
	wrap := func(err error) error {
		return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", err)}
	}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{wrap(syscall.EMFILE), true},
		{wrap(syscall.ENFILE), true},
		{wrap(syscall.ENOBUFS), true},
		{wrap(syscall.ENOMEM), true},
		{wrap(syscall.ECONNABORTED), true},
		{wrap(syscall.EPROTO), true},
		{wrap(os.ErrDeadlineExceeded), true},
		{wrap(syscall.EINVAL), false},
		{wrap(syscall.EBADF), false},
		{wrap(net.ErrClosed), false},
		{errors.New("something else"), false},
	} {
		if got := TransientAcceptError(tc.err); got != tc.want {
			t.Errorf("%v: transient %v, want %v", tc.err, got, tc.want)
		}
	}
}

// TestAcceptorReportsALongRunPeriodically: a run of failures longer than
// ReportEvery is reported again, with the count since the last report.
func TestAcceptorReportsALongRunPeriodically(t *testing.T) {
	l := flaky(t, 40, syscall.EMFILE)
	var logs logLines
	done := make(chan struct{})
	a := NewAcceptor(l, AcceptOptions{Logger: logs.logger(), Done: done, MinDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond, ReportEvery: 20 * time.Millisecond})
	got := make(chan error, 1)
	start := time.Now()
	go func() {
		c, err := a.Accept()
		if err == nil {
			c.Close()
		}
		got <- err
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(deadline.Scale(10 * time.Second)):
		t.Fatal("Accept did not return")
	}
	// 40 failures at least 1 ms apart take at least 40 ms: two reports
	// at least, and one per 20 ms at most after the first.
	elapsed := time.Since(start)
	n := logs.count("accepting connections fails")
	if limit := 1 + int(elapsed/(20*time.Millisecond)); n < 2 || n > limit {
		t.Fatalf("%d reports in %s of failures, want 2..%d:\n%s", n, elapsed, limit, strings.Join(logs.lines, "\n"))
	}
	if logs.count(fmt.Sprintf(`"failures"=%d`, 40)) != 1 {
		t.Fatalf("the recovery report does not count 40 failures:\n%s", strings.Join(logs.lines, "\n"))
	}
}
