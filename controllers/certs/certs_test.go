package certs

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// The tests run against a real kube-apiserver and etcd (envtest) and real
// instance managers serving with the files of the Secret the authority
// writes.
var k8sClient client.Client

func TestMain(m *testing.M) {
	env, err := suite.Start(func(ctrl.Manager, *imclient.Pool) error { return nil }, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}

func newNamespace(t *testing.T) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "certs-"}}
	if err := k8sClient.Create(context.Background(), ns); err != nil {
		t.Fatal(err)
	}
	// Best effort: each test has its own namespace, so one left behind
	// disturbs no other test.
	t.Cleanup(func() { _ = k8sClient.Delete(context.Background(), ns) })
	return ns.Name
}

func secret(t *testing.T, ns, name string) *corev1.Secret {
	t.Helper()
	s := &corev1.Secret{}
	if err := k8sClient.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, s); err != nil {
		t.Fatal(err)
	}
	return s
}

// mount writes the serving Secret's files into dir the way kubelet
// updates a Secret volume: each file replaced whole, by rename.
func mount(t *testing.T, s *corev1.Secret, dir string) {
	t.Helper()
	for _, k := range []string{KeyCACert, KeyTLSCert, KeyTLSKey} {
		tmp := filepath.Join(dir, "."+k+".tmp")
		if err := os.WriteFile(tmp, s.Data[k], 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, k)); err != nil {
			t.Fatal(err)
		}
	}
}

// nodeInfo makes a new connection with cfg and returns the error of one
// call and the issuer of the certificate the instance manager presented.
func nodeInfo(addr string, cfg *tls.Config) (issuer string, err error) {
	cfg = cfg.Clone()
	verify := cfg.VerifyConnection
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) > 0 {
			issuer = cs.PeerCertificates[0].Issuer.CommonName
		}
		if verify != nil {
			return verify(cs)
		}
		return nil
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		return "", err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Second))
	defer cancel()
	_, err = imv1.NewInstanceManagerServiceClient(cc).NodeInfo(ctx, &imv1.NodeInfoRequest{})
	return issuer, err
}

// TestAuthorityWithInstanceManager: the manager's authority makes the CA
// and the instance managers' Secret; an instance manager serving those
// files accepts the manager's pool and nobody without a certificate of
// the CA; a second manager reuses the CA; a CA rotation keeps every new
// connection working while the instance manager still has the old files,
// after it gets the new ones, and after the old CA leaves the bundle,
// without the open connection or the instance manager restarting.
func TestAuthorityWithInstanceManager(t *testing.T) {
	g := NewWithT(t)
	ctx := context.Background()
	ns := newNamespace(t)
	a := New(Options{Namespace: ns, Reader: k8sClient, Writer: k8sClient, Validity: 3 * time.Hour})
	g.Expect(a.Ready(nil)).To(HaveOccurred(), "not ready before the first sync")
	g.Expect(a.Sync(ctx)).To(Succeed())
	g.Expect(a.Ready(nil)).To(Succeed())

	caSecret := secret(t, ns, DefaultCASecret)
	serving := secret(t, ns, DefaultServingSecret)
	g.Expect(serving.Type).To(Equal(corev1.SecretTypeTLS))
	ca1, err := parseCA(caSecret.Data[KeyCACert], caSecret.Data[KeyCAKey])
	g.Expect(err).NotTo(HaveOccurred())
	leaf, err := tls.X509KeyPair(serving.Data[KeyTLSCert], serving.Data[KeyTLSKey])
	g.Expect(err).NotTo(HaveOccurred())
	roots := x509.NewCertPool()
	roots.AddCert(ca1.cert)
	_, err = leaf.Leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: ServerName})
	g.Expect(err).NotTo(HaveOccurred(), "the serving certificate is the CA's, for %s", ServerName)
	g.Expect(leaf.Leaf.NotAfter).To(BeTemporally("~", time.Now().Add(3*time.Hour), time.Minute))

	// Another manager (a standby, or the next one after a restart) takes
	// the CA and the serving Secret as they are.
	b := New(Options{Namespace: ns, Reader: k8sClient, Writer: k8sClient, Validity: 3 * time.Hour})
	g.Expect(b.Sync(ctx)).To(Succeed())
	g.Expect(secret(t, ns, DefaultCASecret).ResourceVersion).To(Equal(caSecret.ResourceVersion))
	g.Expect(secret(t, ns, DefaultServingSecret).ResourceVersion).To(Equal(serving.ResourceVersion))

	// Volume keys: the same for every manager, different per volume.
	k1, err := a.VolumeKey("default", "v1")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(k1).To(HaveLen(32))
	g.Expect(b.VolumeKey("default", "v1")).To(Equal(k1))
	g.Expect(a.VolumeKey("default", "v2")).NotTo(Equal(k1))
	g.Expect(a.VolumeKey("other", "v1")).NotTo(Equal(k1))
	_, err = New(Options{Namespace: ns}).VolumeKey("default", "v1")
	g.Expect(err).To(HaveOccurred(), "no key before the CA Secret is read")

	dir := t.TempDir()
	tlsDir := filepath.Join(dir, "tls")
	g.Expect(os.Mkdir(tlsDir, 0o700)).To(Succeed())
	mount(t, serving, tlsDir)
	im := imtest.Start(t, "n1", "", dir, "--tls-cert", filepath.Join(tlsDir, KeyTLSCert),
		"--tls-key", filepath.Join(tlsDir, KeyTLSKey), "--tls-client-ca", filepath.Join(tlsDir, KeyCACert))

	pool := imclient.New(imclient.Options{DialOptions: []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(a.ClientTLS()))}})
	defer pool.Close()
	conn, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	current := func() bool { _, cur, _ := conn.Processes(); return cur }
	g.Eventually(current, deadline.Scale(20*time.Second), 20*time.Millisecond).Should(BeTrue(), "the pool's watch runs over mutual TLS")

	// Nobody else gets in: no client certificate, or another CA's.
	noCert := &tls.Config{RootCAs: roots, ServerName: ServerName, MinVersion: tls.VersionTLS13}
	_, err = nodeInfo(im.Addr, noCert)
	g.Expect(err).To(HaveOccurred(), "a client without a certificate")
	other, err := newCA(time.Now(), time.Hour)
	g.Expect(err).NotTo(HaveOccurred())
	oc, ok, err := other.issue(ClientName, clientAuth, time.Now(), time.Hour)
	g.Expect(err).NotTo(HaveOccurred())
	intruder, err := tls.X509KeyPair(oc, ok)
	g.Expect(err).NotTo(HaveOccurred())
	withOther := noCert.Clone()
	withOther.Certificates = []tls.Certificate{intruder}
	_, err = nodeInfo(im.Addr, withOther)
	g.Expect(err).To(HaveOccurred(), "a client certificate of another CA, same name")
	// And the manager refuses a server whose certificate is not Cairn's.
	_, err = nodeInfo(im.Addr, a.ClientTLS())
	g.Expect(err).NotTo(HaveOccurred())

	// Rotation.
	patch := client.MergeFrom(caSecret.DeepCopy())
	caSecret.Annotations = map[string]string{AnnotationRotate: "2026-11-25"}
	g.Expect(k8sClient.Patch(ctx, caSecret, patch)).To(Succeed())
	g.Expect(a.Sync(ctx)).To(Succeed())
	caSecret = secret(t, ns, DefaultCASecret)
	ca2, err := parseCA(caSecret.Data[KeyCACert], caSecret.Data[KeyCAKey])
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(ca2.cert.Equal(ca1.cert)).To(BeFalse(), "a new CA")
	g.Expect(caSecret.Data[KeyPreviousCert]).To(Equal(ca1.certPEM), "the old CA kept for the changeover")
	serving = secret(t, ns, DefaultServingSecret)
	g.Expect(string(serving.Data[KeyCACert])).To(Equal(string(ca2.certPEM)+string(ca1.certPEM)), "the bundle trusts both")
	g.Expect(a.Sync(ctx)).To(Succeed())
	g.Expect(secret(t, ns, DefaultCASecret).ResourceVersion).To(Equal(caSecret.ResourceVersion), "one rotation per annotation value")
	g.Expect(a.VolumeKey("default", "v1")).To(Equal(k1), "volume keys survive a CA rotation (running volumes keep theirs)")

	// The instance manager still has the old files: a new connection gets
	// in with the manager's client certificate of the old CA.
	issuer, err := nodeInfo(im.Addr, a.ClientTLS())
	g.Expect(err).NotTo(HaveOccurred(), "new connections work before the instance manager sees the new files")
	g.Expect(issuer).To(Equal(ca1.cert.Subject.CommonName))
	// Kubelet hands it the new files: new connections get the new
	// certificate, with no restart.
	mount(t, serving, tlsDir)
	issuer, err = nodeInfo(im.Addr, a.ClientTLS())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(issuer).To(Equal(ca2.cert.Subject.CommonName), "the instance manager serves the new certificate")

	// The changeover ends: the old CA leaves the bundle, and a client of
	// the old CA is refused from then on.
	patch = client.MergeFrom(caSecret.DeepCopy())
	caSecret.Annotations[annotationPreviousUntil] = time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
	g.Expect(k8sClient.Patch(ctx, caSecret, patch)).To(Succeed())
	g.Expect(a.Sync(ctx)).To(Succeed())
	caSecret = secret(t, ns, DefaultCASecret)
	g.Expect(caSecret.Data).NotTo(HaveKey(KeyPreviousCert))
	g.Expect(caSecret.Data).NotTo(HaveKey(KeyPreviousKey))
	serving = secret(t, ns, DefaultServingSecret)
	g.Expect(serving.Data[KeyCACert]).To(Equal(ca2.certPEM))
	mount(t, serving, tlsDir)
	_, err = nodeInfo(im.Addr, a.ClientTLS())
	g.Expect(err).NotTo(HaveOccurred())
	c1, k1, err := ca1.issue(ClientName, clientAuth, time.Now(), time.Hour)
	g.Expect(err).NotTo(HaveOccurred())
	old, err := tls.X509KeyPair(c1, k1)
	g.Expect(err).NotTo(HaveOccurred())
	withOld := a.ClientTLS()
	withOld.GetClientCertificate = nil
	withOld.Certificates = []tls.Certificate{old}
	_, err = nodeInfo(im.Addr, withOld)
	g.Expect(err).To(HaveOccurred(), "a client certificate of the retired CA")

	g.Expect(current()).To(BeTrue(), "the pool's connection from before the rotation is still up")
	_, err = conn.Client.NodeInfo(ctx, &imv1.NodeInfoRequest{})
	g.Expect(err).NotTo(HaveOccurred())
}

// TestAuthorityRefusesABrokenCA: a CA Secret that does not hold a usable
// CA is not replaced (it is the operator's); the error says what to do.
func TestAuthorityRefusesABrokenCA(t *testing.T) {
	g := NewWithT(t)
	ns := newNamespace(t)
	g.Expect(k8sClient.Create(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: DefaultCASecret, Namespace: ns},
		Data: map[string][]byte{KeyCACert: []byte("not a certificate")}})).To(Succeed())
	a := New(Options{Namespace: ns, Reader: k8sClient, Writer: k8sClient})
	err := a.Sync(context.Background())
	g.Expect(err).To(MatchError(ContainSubstring("delete the Secret to have the manager make a new CA")))
	g.Expect(a.Ready(nil)).To(MatchError(ContainSubstring("no client certificate yet")))
	g.Expect(secret(t, ns, DefaultCASecret).Data).To(Equal(map[string][]byte{KeyCACert: []byte("not a certificate")}), "nothing written to it")
	_, err = a.clientCertificate(&tls.CertificateRequestInfo{})
	g.Expect(err).To(HaveOccurred())
}

// TestLeafNeedsRenewal: the renewal rule, as a table.
func TestLeafNeedsRenewal(t *testing.T) {
	now := time.Now()
	c, err := newCA(now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	other, err := newCA(now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	fresh, freshKey, _ := c.issue(ServerName, serverAuth, now, 3*time.Hour)
	byOther, byOtherKey, _ := other.issue(ServerName, serverAuth, now, 3*time.Hour)
	_, otherKey, _ := c.issue(ServerName, serverAuth, now, 3*time.Hour)
	// A serving certificate without client use, as issued before engines
	// presented theirs to replicas.
	serverOnly, serverOnlyKey := func() ([]byte, []byte) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), NotBefore: now.Add(-time.Minute), NotAfter: now.Add(3 * time.Hour),
			DNSNames: []string{ServerName}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
		if err != nil {
			t.Fatal(err)
		}
		kd, _ := x509.MarshalECPrivateKey(key)
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd})
	}()
	for _, tc := range []struct {
		name      string
		cert, key []byte
		at        time.Time
		want      bool
	}{
		{"fresh", fresh, freshKey, now, false},
		{"two thirds left", fresh, freshKey, now.Add(55 * time.Minute), false},
		{"under a third left", fresh, freshKey, now.Add(2*time.Hour + time.Minute), true},
		{"expired", fresh, freshKey, now.Add(4 * time.Hour), true},
		{"another CA's", byOther, byOtherKey, now, true},
		{"key of another certificate", fresh, otherKey, now, true},
		{"garbage", []byte("x"), []byte("y"), now, true},
		{"server use only", serverOnly, serverOnlyKey, now, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, why := leafNeedsRenewal(tc.cert, tc.key, c, tc.at, 3*time.Hour); got != tc.want {
				t.Fatalf("renew = %v (%s), want %v", got, why, tc.want)
			}
		})
	}
	// A leaf never outlives its CA.
	short, err := newCA(now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cp, kp, _ := short.issue(ClientName, clientAuth, now, 3*time.Hour)
	pair, _ := tls.X509KeyPair(cp, kp)
	if pair.Leaf.NotAfter.After(short.cert.NotAfter) {
		t.Fatalf("leaf until %v outlives its CA (until %v)", pair.Leaf.NotAfter, short.cert.NotAfter)
	}
}
