package backup

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// gateProxy forwards TCP connections to a real server and, while closed,
// holds every byte: a network path that stops delivering without
// breaking the connection (a stalled transfer).
type gateProxy struct {
	l    net.Listener
	to   string
	mu   sync.Mutex
	open *sync.Cond
	shut bool // holding
}

func newGateProxy(t *testing.T, to string) *gateProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &gateProxy{l: l, to: to}
	p.open = sync.NewCond(&p.mu)
	t.Cleanup(func() { l.Close(); p.set(false) })
	go p.serve()
	return p
}

func (p *gateProxy) addr() string { return p.l.Addr().String() }

func (p *gateProxy) set(hold bool) {
	p.mu.Lock()
	p.shut = hold
	p.mu.Unlock()
	p.open.Broadcast()
}

func (p *gateProxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.to)
		if err != nil {
			c.Close()
			continue
		}
		go p.pipe(c, s)
		go p.pipe(s, c)
	}
}

// pipe copies src to dst, waiting at the gate before each write.
func (p *gateProxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			for p.shut {
				p.open.Wait()
			}
			p.mu.Unlock()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF or a closed connection: close both ends
		}
	}
}

// TestBackupStalledRetried: an upload whose replica stops answering
// (its connection held open, nothing delivered) is cancelled after the
// stall timeout, reported failed with reason Stalled, and retried after
// its back-off; once the path delivers again the retry completes.
func TestBackupStalledRetried(t *testing.T) {
	r := newRig(t, "vol-stall")
	ctx := context.Background()
	// Both replicas' control ports through a gate, held shut.
	var proxies []*gateProxy
	for _, n := range []string{"vol-stall-r0", "vol-stall-r1"} {
		rep := &v1.Replica{}
		r.g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: n}, rep)).To(Succeed())
		p := newGateProxy(t, rep.Status.ControlAddress)
		p.set(true)
		proxies = append(proxies, p)
		rep.Status.ControlAddress = p.addr()
		r.g.Expect(k8sClient.Status().Update(ctx, rep)).To(Succeed())
	}
	rec, _ := r.reconciler()
	rec.StallTimeout = deadline.Scale(2 * time.Second)
	rec.RetryBackoff = deadline.Scale(2 * time.Second)
	r.write(0, 2*mib)
	r.backup("st", r.target)

	b := r.until(rec, "st", v1.BackupStateFailed)
	c := meta.FindStatusCondition(b.Status.Conditions, v1.BackupConditionCompleted)
	r.g.Expect(c.Reason).To(Equal(v1.BackupReasonStalled), c.Message)
	r.g.Expect(b.Status.Attempts).To(Equal(int32(1)))
	r.g.Expect(r.listed()).To(BeEmpty())

	for _, p := range proxies {
		p.set(false)
	}
	b = r.until(rec, "st", v1.BackupStateCompleted)
	r.g.Expect(b.Status.Attempts).To(Equal(int32(2)))
	r.g.Expect(b.Status.BytesTotal).To(Equal(int64(2 * mib)))
	r.g.Expect(r.listed()).To(Equal([]string{"st"}))
}
