package dataconn

import (
	"errors"
	"net"
	"syscall"
	"time"

	"github.com/go-logr/logr"
)

// AcceptOptions configure an Acceptor. Zero values take the defaults.
type AcceptOptions struct {
	// Logger receives the reports of a run of failed accepts. Default:
	// discard.
	Logger logr.Logger
	// Done, when closed, ends a back-off at once: the owner is shutting
	// down and Accept returns ErrAcceptStopped.
	Done <-chan struct{}
	// MinDelay is the back-off after the first transient failure; it
	// doubles with each further one up to MaxDelay. Defaults 5 ms and 1 s.
	MinDelay, MaxDelay time.Duration
	// ReportEvery bounds how often a run of failures is reported: its
	// first failure is logged at once, later ones at most this often, as
	// a count. Default 10 s.
	ReportEvery time.Duration
}

// ErrAcceptStopped is returned by Acceptor.Accept when AcceptOptions.Done
// was closed during a back-off.
var ErrAcceptStopped = errors.New("dataconn: accept stopped")

// Acceptor takes connections from a listener for a serve loop, riding out
// failures that pass on their own: a process out of descriptors (EMFILE,
// ENFILE), a kernel short of memory (ENOBUFS, ENOMEM), a connection gone
// before it was taken (ECONNABORTED), network errors accept(2) says to
// retry, and timeouts. A serve loop that returned on them would take its
// volume down because of a moment's pressure. Between attempts it waits
// an exponential back-off, reset by the next success; it reports a run of
// failures once when it starts, then at most every ReportEvery, and once
// when an accept succeeds again. Not safe for concurrent use: one serve
// loop owns it.
type Acceptor struct {
	l    net.Listener
	opts AcceptOptions

	delay      time.Duration // the next back-off; 0 after a success
	failures   int           // failures in the current run
	unreported int           // failures since the last report
	since      time.Time     // when the current run began
	reported   time.Time     // when the run was last reported
}

// NewAcceptor returns an Acceptor on l.
func NewAcceptor(l net.Listener, opts AcceptOptions) *Acceptor {
	if opts.MinDelay <= 0 {
		opts.MinDelay = 5 * time.Millisecond
	}
	if opts.MaxDelay < opts.MinDelay {
		opts.MaxDelay = max(time.Second, opts.MinDelay)
	}
	if opts.ReportEvery <= 0 {
		opts.ReportEvery = 10 * time.Second
	}
	return &Acceptor{l: l, opts: opts}
}

// Accept returns the next connection, retrying transient failures. It
// returns the listener's error when it is permanent (net.ErrClosed once
// the listener is closed), or ErrAcceptStopped when Done is closed during
// a back-off.
func (a *Acceptor) Accept() (net.Conn, error) {
	for {
		nc, err := a.l.Accept()
		if err == nil {
			a.succeeded()
			return nc, nil
		}
		if !TransientAcceptError(err) {
			return nil, err
		}
		a.failed(err)
		t := time.NewTimer(a.delay)
		select {
		case <-t.C:
		case <-a.opts.Done:
			t.Stop()
			return nil, ErrAcceptStopped
		}
		a.delay = min(2*a.delay, a.opts.MaxDelay)
	}
}

func (a *Acceptor) failed(err error) {
	now := time.Now()
	if a.failures == 0 {
		a.since = now
		a.delay = a.opts.MinDelay
	}
	a.failures++
	a.unreported++
	if a.failures == 1 || now.Sub(a.reported) >= a.opts.ReportEvery {
		a.opts.Logger.Info("accepting connections fails; retrying with back-off",
			"listener", a.l.Addr().String(), "error", err.Error(), "failures", a.unreported,
			"failingFor", now.Sub(a.since).Round(time.Millisecond).String(), "nextTry", a.delay.String())
		a.reported, a.unreported = now, 0
	}
}

func (a *Acceptor) succeeded() {
	if a.failures == 0 {
		return
	}
	a.opts.Logger.Info("accepting connections again", "listener", a.l.Addr().String(),
		"failures", a.failures, "failedFor", time.Since(a.since).Round(time.Millisecond).String())
	a.failures, a.unreported, a.delay = 0, 0, 0
}

// TransientAcceptError reports whether an error from Accept may pass on
// its own, so that the serve loop should wait and try again: resource
// exhaustion (EMFILE, ENFILE, ENOBUFS, ENOMEM), a connection that went
// away before it was taken (ECONNABORTED), the pending network errors
// accept(2) says to treat as EAGAIN (ENETDOWN, EPROTO, ENOPROTOOPT,
// EHOSTDOWN, ENONET, EHOSTUNREACH, ENETUNREACH), a connection a firewall
// rule refused (EPERM), and timeouts. A closed listener is permanent.
func TransientAcceptError(err error) bool {
	if errors.Is(err, net.ErrClosed) {
		return false
	}
	for _, e := range transientAcceptErrnos {
		if errors.Is(err, e) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

var transientAcceptErrnos = []syscall.Errno{
	syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED,
	syscall.ENETDOWN, syscall.EPROTO, syscall.ENOPROTOOPT, syscall.EHOSTDOWN, syscall.ENONET,
	syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EPERM,
}
