package backup

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	ctrl "sigs.k8s.io/controller-runtime"
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
	proxies := r.gateReplicas()
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

// gateReplicas puts both replicas' control ports behind gates, held shut.
func (r *rig) gateReplicas() []*gateProxy {
	ctx := context.Background()
	var proxies []*gateProxy
	for i := range 2 {
		rep := &v1.Replica{}
		r.g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: fmt.Sprintf("%s-r%d", r.vol, i)}, rep)).To(Succeed())
		p := newGateProxy(r.t, rep.Status.ControlAddress)
		p.set(true)
		proxies = append(proxies, p)
		rep.Status.ControlAddress = p.addr()
		r.g.Expect(k8sClient.Status().Update(ctx, rep)).To(Succeed())
	}
	return proxies
}

// TestBackupDeletedWhileUploading: deleting a Backup whose upload runs
// cancels the upload and lets the object go; nothing is left listed on the
// target, and the path delivering again later writes nothing.
func TestBackupDeletedWhileUploading(t *testing.T) {
	r := newRig(t, "vol-delrun")
	proxies := r.gateReplicas()
	rec, _ := r.reconciler()
	rec.StallTimeout = time.Hour
	r.write(0, 2*mib)
	r.backup("dr", r.target)
	r.until(rec, "dr", v1.BackupStateInProgress)
	_, running := rec.uploads.state(client.ObjectKey{Namespace: ns, Name: "dr"})
	r.g.Expect(running).To(BeTrue())

	r.g.Expect(k8sClient.Delete(context.Background(), r.get("dr"))).To(Succeed())
	r.g.Eventually(func() bool {
		_, _ = rec.Reconcile(context.Background(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: ns, Name: "dr"}})
		return apierrors.IsNotFound(k8sClient.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: "dr"}, &v1.Backup{}))
	}, timeout, 50*time.Millisecond).Should(BeTrue())
	_, running = rec.uploads.state(client.ObjectKey{Namespace: ns, Name: "dr"})
	r.g.Expect(running).To(BeFalse(), "the upload was cancelled and forgotten")
	for _, p := range proxies {
		p.set(false)
	}
	rec.uploads.wait()
	r.g.Expect(r.listed()).To(BeEmpty())
}
