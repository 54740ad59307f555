package volume

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

// tlsRestoreVolume is the volume the TLS restore test restores into:
// its replicas take the data key Cairn's CA derives for default/<name>.
const (
	tlsRestoreVolume = "rt-vol"
	tlsRestoreSize   = 8 << 20
)

// startTLSReplicas starts an instance manager serving with the serving
// Secret's files of the authority a, with mutual TLS on its and its
// children's control APIs and --data-tls on the replicas' data ports, and
// two replicas of tlsRestoreVolume on it holding the volume's key. It
// returns their addresses as the volume reconciler hands them to a
// restore ("data,control").
func startTLSReplicas(t *testing.T, g *WithT, a *certs.Authority, ns string) []string {
	serving := &corev1.Secret{}
	g.Expect(k8sClient.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: certs.DefaultServingSecret}, serving)).To(Succeed())
	dir := t.TempDir()
	tlsDir := filepath.Join(dir, "tls")
	g.Expect(os.Mkdir(tlsDir, 0o700)).To(Succeed())
	for _, k := range []string{certs.KeyCACert, certs.KeyTLSCert, certs.KeyTLSKey} {
		g.Expect(os.WriteFile(filepath.Join(tlsDir, k), serving.Data[k], 0o600)).To(Succeed())
	}
	data := filepath.Join(dir, "data")
	g.Expect(os.Mkdir(data, 0o700)).To(Succeed())
	im := imtest.Start(t, "rt-node", "", data, "--tls-cert", filepath.Join(tlsDir, certs.KeyTLSCert),
		"--tls-key", filepath.Join(tlsDir, certs.KeyTLSKey), "--tls-client-ca", filepath.Join(tlsDir, certs.KeyCACert), "--data-tls")

	cc, err := grpc.NewClient(im.Addr, grpc.WithTransportCredentials(credentials.NewTLS(a.ClientTLS())))
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { cc.Close() })
	imc := imv1.NewInstanceManagerServiceClient(cc)
	key, err := a.VolumeKey("default", tlsRestoreVolume)
	g.Expect(err).NotTo(HaveOccurred())
	ctx := context.Background()
	var addrs []string
	for _, name := range []string{"default/rt-vol-r0", "default/rt-vol-r1"} {
		_, err := imc.ProcessCreate(ctx, &imv1.ProcessCreateRequest{Name: name, Spec: &imv1.ProcessCreateRequest_Replica{Replica: &imv1.ReplicaSpec{
			DataDir: filepath.Join(data, filepath.Base(name)), SizeBytes: tlsRestoreSize, AuthKey: key}}})
		g.Expect(err).NotTo(HaveOccurred())
		var p *imv1.Process
		g.Eventually(func() imv1.ProcessState {
			p, err = imc.ProcessGet(ctx, &imv1.ProcessGetRequest{Name: name})
			g.Expect(err).NotTo(HaveOccurred())
			return p.State
		}, timeout, 50*time.Millisecond).Should(Equal(imv1.ProcessState_PROCESS_STATE_RUNNING), "replica %s", name)
		addrs = append(addrs, p.DataAddress+","+p.ControlAddress)
	}
	return addrs
}

// newTLSRestoreStore is a store on the versitygw bucket; each restore run
// closes its store's target when it ends, so each gets its own.
func newTLSRestoreStore(g *WithT, gw *versitygw.Server) (*backupstore.Store, backupstore.Target) {
	tg, err := backupstore.NewS3Target(backupstore.S3Config{Endpoint: gw.Endpoint, Bucket: "backups", Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey})
	g.Expect(err).NotTo(HaveOccurred())
	store, err := backupstore.New(tg, backupstore.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	return store, tg
}

// runTLSRestore runs a restore of backup src/b1 into the replicas at
// addrs with opts, handing it the addresses as the reconciler does (at
// every look, until it ends), and returns how it ended.
func runTLSRestore(t *testing.T, g *WithT, gw *versitygw.Server, addrs []string, opts RestoreOptions) restoreView {
	store, tg := newTLSRestoreStore(g, gw)
	rs := &restoreRuns{}
	t.Cleanup(rs.stopAll)
	run := rs.start(types.UID("rt-"+t.Name()), restoreJob{store: store, target: tg,
		src:    v1.VolumeBackupSource{Target: "rt-target", Volume: "src", Name: "b1"},
		volume: tlsRestoreVolume, namespace: "default", size: tlsRestoreSize, opts: opts,
		log: testr.New(t), notify: func() {}})
	var view restoreView
	g.Eventually(func() restorePhase {
		run.give(addrs)
		view = run.view()
		return view.phase
	}, timeout, 50*time.Millisecond).Should(Equal(restoreDone))
	return view
}

// tlsImage is the backup's content: patterns in the first block, across
// a block boundary and at the end, zeros elsewhere.
func tlsImage() []byte {
	image := make([]byte, tlsRestoreSize)
	copy(image[0:], bytes.Repeat([]byte{0x21}, 1<<20))
	copy(image[3<<20+512<<10:], bytes.Repeat([]byte{0x43}, 1<<20))
	copy(image[tlsRestoreSize-64<<10:], bytes.Repeat([]byte{0x65}, 64<<10))
	return image
}

// TestRestoreOverMutualTLS restores a backup through restore runs as the
// manager starts them with Cairn's CA (cmd/manager: RestoreOptions.Keys,
// ControlTLS and DataTLS from the certs.Authority) into replicas of an
// instance manager that serves its own and its replicas' control APIs
// with mutual TLS and the replicas' data ports with --data-tls and the
// volume's key. A restore whose TLS or key does not match the replicas'
// (no client certificate on the control API or on the data port, a
// plain control or data connection, another CA, another master key) fails
// with reason
// RestoreFailed and a message naming the cause, and writes nothing; the
// restore with the CA's configuration then writes and verifies the
// backup, and every byte read back from each replica, over the same TLS,
// equals the backup's.
func TestRestoreOverMutualTLS(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "rt-pki-"}}
	g.Expect(k8sClient.Create(ctx, ns)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, ns) })
	a := certs.New(certs.Options{Namespace: ns.Name, Reader: k8sClient, Writer: k8sClient, Validity: 3 * time.Hour})
	g.Expect(a.Sync(ctx)).To(Succeed())
	addrs := startTLSReplicas(t, g, a, ns.Name)

	gw, err := versitygw.Start(versitygw.Options{Dir: t.TempDir(), Bucket: "backups"})
	if err != nil {
		t.Skipf("no S3 server for the restore tests: %v", err)
	}
	t.Cleanup(gw.Stop)
	image := tlsImage()
	store, _ := newTLSRestoreStore(g, gw)
	bctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	_, err = store.Backup(bctx, backupstore.BackupOptions{Volume: "src", Name: "b1", Source: bytes.NewReader(image), Size: tlsRestoreSize,
		BlockSize: 2 << 20})
	g.Expect(err).NotTo(HaveOccurred())

	caTLS := RestoreOptions{Keys: a, ControlTLS: a.ClientTLS(), DataTLS: a.ClientTLS(), OpenTimeout: deadline.Scale(30 * time.Second)}
	serving := &corev1.Secret{}
	g.Expect(k8sClient.Get(ctx, types.NamespacedName{Namespace: ns.Name, Name: certs.DefaultServingSecret}, serving)).To(Succeed())
	roots := x509.NewCertPool()
	g.Expect(roots.AppendCertsFromPEM(serving.Data[certs.KeyCACert])).To(BeTrue())
	noClientCert := &tls.Config{MinVersion: tls.VersionTLS13, ServerName: certs.ServerName, RootCAs: roots}
	// Another manager's CA: it trusts no certificate of this cluster's.
	otherNS := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "rt-pki-other-"}}
	g.Expect(k8sClient.Create(ctx, otherNS)).To(Succeed())
	t.Cleanup(func() { _ = k8sClient.Delete(ctx, otherNS) })
	other := certs.New(certs.Options{Namespace: otherNS.Name, Reader: k8sClient, Writer: k8sClient, Validity: 3 * time.Hour})
	g.Expect(other.Sync(ctx)).To(Succeed())

	// Each refused before anything is written: the manager's side of one
	// of the connections does not match the replicas'. The message names
	// the cause, or the setting to fix where the error alone does not
	// (connectHint).
	failOpen := deadline.Scale(15 * time.Second)
	cases := []struct {
		name string
		opts func(o *RestoreOptions)
		is   func(error) bool // finds the cause in the error
		msg  string           // what the message says of it
	}{
		{"control API without a client certificate", func(o *RestoreOptions) { o.ControlTLS = noClientCert }, isErr(replicaclient.ErrControlTLS), "do not accept its client certificate"},
		{"control API without TLS", func(o *RestoreOptions) { o.ControlTLS = nil }, isErr(replicaclient.ErrNoControlAPI), "run the manager with --instance-manager-tls"},
		{"data port without a client certificate", func(o *RestoreOptions) { o.DataTLS = noClientCert }, isRemoteTLSAlert, "tls: certificate required"},
		{"plain data port (manager without --data-tls)", func(o *RestoreOptions) { o.DataTLS = nil }, isErr(dataconn.ErrAuthMalformed), "run the manager with --data-tls too"},
		{"another CA", func(o *RestoreOptions) { o.ControlTLS, o.DataTLS = other.ClientTLS(), other.ClientTLS() }, asErr[x509.UnknownAuthorityError], "not one Cairn's CA issued"},
		{"another master key", func(o *RestoreOptions) { o.Keys = certs.MasterKey(bytes.Repeat([]byte{7}, 32)) }, isErr(dataconn.ErrAuthRefused), "authentication refused"},
	}
	// The refused runs fail only when their wait for the replicas ends
	// (OpenTimeout): they run at once.
	t.Run("refused", func(t *testing.T) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				g := NewWithT(t)
				opts := caTLS
				opts.OpenTimeout = failOpen
				tc.opts(&opts)
				view := runTLSRestore(t, g, gw, addrs, opts)
				g.Expect(view.err).To(HaveOccurred())
				t.Logf("refused: %v", view.err)
				g.Expect(view.reason).To(Equal(v1.VolumeReasonRestoreFailed))
				g.Expect(tc.is(view.err)).To(BeTrue(), "the cause is in the error's chain: %v", view.err)
				g.Expect(view.err.Error()).To(ContainSubstring(tc.msg))
			})
		}
	})

	// Nothing reached the replicas: they read zeros.
	for _, addr := range addrs {
		got := readReplica(t, g, a, addrs, addr)
		g.Expect(bytes.Count(got, []byte{0})).To(Equal(len(got)), "replica %s after the refused restores", addr)
	}

	t.Run("the CA's configuration", func(t *testing.T) {
		g := NewWithT(t)
		view := runTLSRestore(t, g, gw, addrs, caTLS)
		g.Expect(view.err).NotTo(HaveOccurred())
		g.Expect(view.reason).To(BeEmpty())
		g.Expect(view.done).To(Equal(view.total), "written, then verified on both replicas")
		for _, addr := range addrs {
			got := readReplica(t, g, a, addrs, addr)
			g.Expect(bytes.Equal(got, image)).To(BeTrue(), "replica %s: %s", addr, firstDiff(got, image))
		}
	})
}

func isErr(target error) func(error) bool {
	return func(err error) bool { return errors.Is(err, target) }
}

// isRemoteTLSAlert: the peer sent a TLS alert (crypto/tls reports one
// received on a TCP connection as a *net.OpError "remote error").
func isRemoteTLSAlert(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error"
}

func asErr[T error](err error) bool {
	var target T
	return errors.As(err, &target)
}

// readReplica reads the whole volume from the replica at addr, over the
// CA's TLS with the volume's key, at the epoch of an engine opened on all
// of addrs (replicas fence reads with it).
func readReplica(t *testing.T, g *WithT, a *certs.Authority, addrs []string, addr string) []byte {
	key, err := a.VolumeKey("default", tlsRestoreVolume)
	g.Expect(err).NotTo(HaveOccurred())
	ropts := replicaclient.Options{Data: dataconn.ClientOptions{Key: key, TLS: a.ClientTLS()}, ControlTLS: a.ClientTLS()}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	e, err := engine.Open(ctx, engine.Options{Name: tlsRestoreVolume, Size: tlsRestoreSize, Replicas: addrs, Dial: replicaclient.Dialer(ropts), Logger: testr.New(t)})
	g.Expect(err).NotTo(HaveOccurred())
	defer e.Close()
	c, err := replicaclient.Dial(ctx, addr, ropts)
	g.Expect(err).NotTo(HaveOccurred())
	defer c.Close()
	c.SetRequestEpoch(e.Epoch())
	got := make([]byte, tlsRestoreSize)
	for off := 0; off < len(got); off += 1 << 20 {
		g.Expect(c.ReadAt(ctx, got[off:off+1<<20], int64(off))).To(Succeed(), "replica %s at %d", addr, off)
	}
	return got
}
