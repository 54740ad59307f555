package backuptarget

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

// The tests run the reconciler in a manager against a real API server
// (envtest) and a real S3 server: versitygw v1.8.0 with its posix backend
// on a temporary directory, built by hack/install-versitygw.sh.
var (
	k8sClient client.Client
	s3        s3Server
	// s3tls serves HTTPS with a certificate of a private CA.
	s3tls s3Server
	// probeTimeout is the reconciler's bound on one check, short so that
	// a stalled endpoint's test ends soon.
	probeTimeout = deadline.Scale(3 * time.Second)
)

// s3Server is the running versitygw: its endpoint, the credentials it
// accepts, and a client to look into its buckets.
type s3Server struct {
	endpoint, access, secret string
	client                   *minio.Client
	bin                      string
	// caPEM is the CA a TLS server's certificate chains to.
	caPEM []byte
}

// bucket is the bucket the server has; others do not exist.
const bucket = "backups"

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	tmp, err := os.MkdirTemp("", "backuptarget-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	var stop, stopTLS func()
	s3, stop, err = startVersitygw(filepath.Join(tmp, "plain"), nil, nil, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	caPEM, certPEM, keyPEM, err := testCA()
	if err == nil {
		s3tls, stopTLS, err = startVersitygw(filepath.Join(tmp, "tls"), certPEM, keyPEM, caPEM)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stopTLS()
	s3tls.caPEM = caPEM
	env, err := suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		return (&Reconciler{ProbeTimeout: probeTimeout, MinRetry: time.Second}).SetupWithManager(mgr)
	}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer env.Stop()
	k8sClient = env.Client
	return m.Run()
}

// startVersitygw runs versitygw over dir with its internal IAM (so tests
// can add users with fewer rights) and the bucket; stop kills it. With
// certPEM and keyPEM it serves HTTPS with that certificate, and trusts
// caPEM to reach it.
func startVersitygw(dir string, certPEM, keyPEM, caPEM []byte) (srv s3Server, stop func(), err error) {
	gw, err := versitygw.Start(versitygw.Options{Dir: dir, Bucket: bucket, IAM: true, CertPEM: certPEM, KeyPEM: keyPEM, CAPEM: caPEM})
	if err != nil {
		return srv, nil, err
	}
	return s3Server{endpoint: gw.Endpoint, access: versitygw.AccessKey, secret: versitygw.SecretKey, client: gw.Client, bin: gw.Bin}, gw.Stop, nil
}

// testCA makes a CA and a server certificate it signed for 127.0.0.1,
// all PEM.
func testCA() (caPEM, certPEM, keyPEM []byte, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "backuptarget test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caTmpl, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
