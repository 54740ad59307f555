package backuptarget

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
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

const versitygwVersion = "v1.8.0"

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

// versitygwBinary finds the server hack/install-versitygw.sh built.
func versitygwBinary() (string, error) {
	if p := os.Getenv("CAIRN_VERSITYGW"); p != "" {
		return p, nil
	}
	cache := os.Getenv("CAIRN_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "cairn")
	}
	p := filepath.Join(cache, "versitygw-"+versitygwVersion, "versitygw")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("versitygw %s not found at %s: run make test-tools (hack/install-versitygw.sh) or set CAIRN_VERSITYGW", versitygwVersion, p)
	}
	return p, nil
}

// startVersitygw runs versitygw on 127.0.0.1 over dir/root, with its
// internal IAM in dir/iam (so tests can add users with fewer rights), and
// creates the bucket; stop kills it. With certPEM and keyPEM it serves
// HTTPS with that certificate, and trusts caPEM to reach it.
func startVersitygw(dir string, certPEM, keyPEM, caPEM []byte) (srv s3Server, stop func(), err error) {
	bin, err := versitygwBinary()
	if err != nil {
		return srv, nil, err
	}
	port, err := freePort()
	if err != nil {
		return srv, nil, err
	}
	root, iam := filepath.Join(dir, "root"), filepath.Join(dir, "iam")
	for _, d := range []string{root, iam} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return srv, nil, err
		}
	}
	scheme := "http"
	const access, secret = "cairn-test-access", "cairn-test-secret-key"
	args := []string{"--access", access, "--secret", secret,
		"--port", fmt.Sprintf("127.0.0.1:%d", port), "--iam-dir", iam, "--quiet"}
	if certPEM != nil {
		scheme = "https"
		cert, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
		if err := errors.Join(os.WriteFile(cert, certPEM, 0o600), os.WriteFile(key, keyPEM, 0o600)); err != nil {
			return srv, nil, err
		}
		args = append(args, "--cert", cert, "--key", key)
	}
	srv = s3Server{endpoint: fmt.Sprintf("%s://127.0.0.1:%d", scheme, port), access: access, secret: secret, bin: bin}
	logf, err := os.Create(filepath.Join(dir, "versitygw.log"))
	if err != nil {
		return srv, nil, err
	}
	cmd := exec.Command(bin, append(args, "posix", root)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return srv, nil, err
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); _ = logf.Close() }
	if err := srv.connect(port, caPEM); err != nil {
		stop()
		out, _ := os.ReadFile(logf.Name())
		return srv, nil, errors.Join(err, errors.New(string(out)))
	}
	return srv, stop, nil
}

// connect makes the server's client and creates the bucket, waiting for
// the server to answer.
func (srv *s3Server) connect(port int, caPEM []byte) error {
	opts := &minio.Options{Creds: credentials.NewStaticV4(srv.access, srv.secret, ""), Region: "us-east-1",
		BucketLookup: minio.BucketLookupPath, Secure: caPEM != nil}
	if caPEM != nil {
		tr, err := minio.DefaultTransport(true)
		if err != nil {
			return err
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(caPEM)
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		opts.Transport = tr
	}
	var err error
	if srv.client, err = minio.New(fmt.Sprintf("127.0.0.1:%d", port), opts); err != nil {
		return err
	}
	for until := deadline.After(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Second))
		err = srv.client.MakeBucket(ctx, bucket, minio.MakeBucketOptions{Region: "us-east-1"})
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(until) {
			return fmt.Errorf("versitygw on port %d did not create a bucket: %w", port, err)
		}
	}
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
