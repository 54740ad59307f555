// Package versitygw runs the S3 server the backup tests use: versitygw
// with its posix backend over a directory, on 127.0.0.1, with one bucket.
// hack/install-versitygw.sh (make test-tools) builds it outside the clone.
package versitygw

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Version is the versitygw release hack/install-versitygw.sh builds.
const Version = "v1.8.0"

// The credentials the server accepts, and the region its clients use.
const (
	AccessKey = "cairn-test-access"
	SecretKey = "cairn-test-secret-key"
	Region    = "us-east-1"
)

// Binary is the server hack/install-versitygw.sh built: $CAIRN_VERSITYGW,
// else versitygw-<Version>/versitygw under $CAIRN_CACHE (default
// ~/.cache/cairn).
func Binary() (string, error) {
	if p := os.Getenv("CAIRN_VERSITYGW"); p != "" {
		return p, nil
	}
	cache := os.Getenv("CAIRN_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "cairn")
	}
	p := filepath.Join(cache, "versitygw-"+Version, "versitygw")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("versitygw %s not found at %s: run make test-tools (hack/install-versitygw.sh) or set CAIRN_VERSITYGW", Version, p)
	}
	return p, nil
}

// Options says how to run the server.
type Options struct {
	// Dir holds the server's data (Dir/root), its log and, as asked, its
	// IAM and TLS files.
	Dir string
	// Bucket is created once the server answers.
	Bucket string
	// IAM keeps users in Dir/iam, so tests can add users with fewer
	// rights (versitygw admin).
	IAM bool
	// CertPEM and KeyPEM, when set, make it serve HTTPS with that
	// certificate; its client trusts CAPEM.
	CertPEM, KeyPEM, CAPEM []byte
}

// Server is a running versitygw.
type Server struct {
	// Endpoint is its URL (http:// or https://127.0.0.1:port).
	Endpoint string
	// Bin is the binary it runs (for versitygw admin).
	Bin string
	// Client reaches it with AccessKey and SecretKey, path-style.
	Client *minio.Client

	cmd *exec.Cmd
	log *os.File
}

// Start runs the server and returns once Bucket exists in it.
func Start(o Options) (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	root := filepath.Join(o.Dir, "root")
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	args := []string{"--access", AccessKey, "--secret", SecretKey, "--port", fmt.Sprintf("127.0.0.1:%d", port), "--quiet"}
	if o.IAM {
		iam := filepath.Join(o.Dir, "iam")
		if err := os.MkdirAll(iam, 0o700); err != nil {
			return nil, err
		}
		args = append(args, "--iam-dir", iam)
	}
	scheme := "http"
	if o.CertPEM != nil {
		scheme = "https"
		cert, key := filepath.Join(o.Dir, "tls.crt"), filepath.Join(o.Dir, "tls.key")
		if err := errors.Join(os.WriteFile(cert, o.CertPEM, 0o600), os.WriteFile(key, o.KeyPEM, 0o600)); err != nil {
			return nil, err
		}
		args = append(args, "--cert", cert, "--key", key)
	}
	s := &Server{Endpoint: fmt.Sprintf("%s://127.0.0.1:%d", scheme, port), Bin: bin}
	if s.log, err = os.Create(filepath.Join(o.Dir, "versitygw.log")); err != nil {
		return nil, err
	}
	s.cmd = exec.Command(bin, append(args, "posix", root)...)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		_ = s.log.Close()
		return nil, err
	}
	if err := s.connect(port, o); err != nil {
		s.Stop()
		return nil, fmt.Errorf("%w; versitygw log:\n%s", err, s.Log())
	}
	return s, nil
}

// connect makes the server's client and creates the bucket, waiting for
// the server to answer.
func (s *Server) connect(port int, o Options) error {
	opts := &minio.Options{Creds: credentials.NewStaticV4(AccessKey, SecretKey, ""), Region: Region,
		BucketLookup: minio.BucketLookupPath, Secure: o.CertPEM != nil}
	if o.CertPEM != nil {
		tr, err := minio.DefaultTransport(true)
		if err != nil {
			return err
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(o.CAPEM)
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		opts.Transport = tr
	}
	var err error
	if s.Client, err = minio.New(fmt.Sprintf("127.0.0.1:%d", port), opts); err != nil {
		return err
	}
	for until := deadline.After(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Second))
		err = s.Client.MakeBucket(ctx, o.Bucket, minio.MakeBucketOptions{Region: Region})
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(until) {
			return fmt.Errorf("versitygw on port %d did not create bucket %s: %w", port, o.Bucket, err)
		}
	}
}

// Stop kills the server.
func (s *Server) Stop() {
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	_ = s.log.Close()
}

// Log is what the server wrote.
func (s *Server) Log() string {
	out, _ := os.ReadFile(s.log.Name())
	return string(out)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
