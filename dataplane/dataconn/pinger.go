package dataconn

import (
	"context"
	"sync"
	"time"
)

// Pinger sends the liveness pings of many clients from one timer: at each
// tick it starts a ping on every registered client (each on its next
// connection in turns), and one goroutine waits for their answers. A
// process with several clients (an engine has one per replica) then wakes
// once per interval for its pings instead of once per client, which is
// most of what an idle engine does. A client whose ping fails or goes
// unanswered for the timeout (counted from when it was sent) fails as it
// would with its own timer; a slow or silent server delays neither the
// next tick nor another client's pings, so each server is still found
// silent within interval plus timeout.
type Pinger struct {
	interval, timeout time.Duration

	mu      sync.Mutex
	clients map[*Client]struct{}
	running bool // the loop runs; it stops when no client is left
}

// NewPinger returns a Pinger that pings every interval and fails a client
// whose ping is unanswered after timeout (defaults as ClientOptions').
func NewPinger(interval, timeout time.Duration) *Pinger {
	if interval <= 0 {
		interval = 2 * time.Second
	}
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	return &Pinger{interval: interval, timeout: timeout, clients: map[*Client]struct{}{}}
}

// add registers c until it is done, starting the loop if it was stopped.
func (p *Pinger) add(c *Client) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clients[c] = struct{}{}
	if !p.running {
		p.running = true
		go p.loop()
	}
}

// due returns the clients to ping now, dropping those that are done; it
// reports false, and marks the loop stopped, when none is left.
func (p *Pinger) due() ([]*Client, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*Client
	for c := range p.clients {
		select {
		case <-c.done:
			delete(p.clients, c)
		default:
			out = append(out, c)
		}
	}
	if len(p.clients) == 0 {
		p.running = false
		return nil, false
	}
	return out, true
}

func (p *Pinger) loop() {
	t := time.NewTicker(p.interval)
	defer t.Stop()
	for range t.C {
		cs, ok := p.due()
		if !ok {
			return
		}
		pings := make([]*Pending, len(cs))
		for i, c := range cs {
			pings[i] = c.startPing(p.timeout)
		}
		go func() {
			for _, pg := range pings {
				_ = pg.Wait(context.Background()) // a failed ping fails its client; startOn or Wait said why
			}
		}()
	}
}

// pingLoop checks the server's liveness on an interval, pinging one
// connection per interval in turns (a client without a Pinger). A server
// that went silent (its node gone) or closed its end is found within an
// interval whichever connection is pinged, and the client fails as a
// whole; one connection broken on its own is found within Conns
// intervals. Pinging every connection each interval found nothing sooner
// and woke both ends once per connection.
func (c *Client) pingLoop() {
	defer c.wg.Done()
	t := time.NewTicker(c.opts.PingInterval)
	defer t.Stop()
	for {
		select {
		case <-c.done:
			return
		case <-t.C:
		}
		if err := c.startPing(c.opts.PingTimeout).Wait(context.Background()); err != nil {
			return // the client has failed; startOn or Wait said why
		}
	}
}

// startPing sends a ping on the next connection in turn.
func (c *Client) startPing(timeout time.Duration) *Pending {
	i := c.pingNext.Add(1) - 1
	return c.startOn(c.conns[i%uint64(len(c.conns))], &call{op: OpPing}, Header{Op: OpPing}, timeout)
}
