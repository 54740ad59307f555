package backuptarget

import (
	"context"
	"errors"
	"fmt"
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
	stop, err := startVersitygw(tmp)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
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
// creates the bucket; stop kills it.
func startVersitygw(dir string) (stop func(), err error) {
	bin, err := versitygwBinary()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	root, iam := filepath.Join(dir, "root"), filepath.Join(dir, "iam")
	for _, d := range []string{root, iam} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return nil, err
		}
	}
	s3 = s3Server{endpoint: fmt.Sprintf("http://127.0.0.1:%d", port), access: "cairn-test-access", secret: "cairn-test-secret-key", bin: bin}
	logf, err := os.Create(filepath.Join(dir, "versitygw.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "--access", s3.access, "--secret", s3.secret,
		"--port", fmt.Sprintf("127.0.0.1:%d", port), "--iam-dir", iam, "--quiet", "posix", root)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); _ = logf.Close() }
	s3.client, err = minio.New(fmt.Sprintf("127.0.0.1:%d", port), &minio.Options{
		Creds: credentials.NewStaticV4(s3.access, s3.secret, ""), Region: "us-east-1", BucketLookup: minio.BucketLookupPath})
	if err != nil {
		stop()
		return nil, err
	}
	for until := deadline.After(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Second))
		err = s3.client.MakeBucket(ctx, bucket, minio.MakeBucketOptions{Region: "us-east-1"})
		cancel()
		if err == nil {
			return stop, nil
		}
		if time.Now().After(until) {
			stop()
			out, _ := os.ReadFile(logf.Name())
			return nil, errors.Join(fmt.Errorf("versitygw on port %d did not create a bucket: %w", port, err), errors.New(string(out)))
		}
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
