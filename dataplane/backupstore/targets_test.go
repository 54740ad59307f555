package backupstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// versitygwVersion is the S3 server the tests run (hack/install-versitygw.sh).
const versitygwVersion = "v1.8.0"

// targetKind builds a fresh, empty target of one kind for a test, and
// says how to open the same target again (from a child process).
type targetKind struct {
	name string
	new  func(t *testing.T) (Target, childTarget)
}

// childTarget is what a child process needs to open the same target.
type childTarget struct {
	Dir string
	S3  S3Config
}

func (c childTarget) open() (Target, error) {
	if c.Dir != "" {
		return NewDirTarget(c.Dir)
	}
	return NewS3Target(c.S3)
}

// targetKinds: a directory (as an NFS export would be mounted) and a real
// S3 server (versitygw with its posix backend on a temporary directory).
func targetKinds() []targetKind {
	return []targetKind{
		{"dir", func(t *testing.T) (Target, childTarget) {
			dir := t.TempDir()
			tg, err := NewDirTarget(dir)
			if err != nil {
				t.Fatal(err)
			}
			return tg, childTarget{Dir: dir}
		}},
		{"s3", func(t *testing.T) (Target, childTarget) {
			cfg := startVersitygw(t)
			tg, err := NewS3Target(cfg)
			if err != nil {
				t.Fatal(err)
			}
			return tg, childTarget{S3: cfg}
		}},
	}
}

// versitygwBinary finds the server hack/install-versitygw.sh built.
func versitygwBinary(t *testing.T) string {
	if p := os.Getenv("CAIRN_VERSITYGW"); p != "" {
		return p
	}
	cache := os.Getenv("CAIRN_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "cairn")
	}
	p := filepath.Join(cache, "versitygw-"+versitygwVersion, "versitygw")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("versitygw %s not found at %s: run make test-tools (hack/install-versitygw.sh) or set CAIRN_VERSITYGW", versitygwVersion, p)
	}
	return p
}

// startVersitygw runs versitygw on 127.0.0.1 over a temporary directory,
// creates a bucket and returns the config of a target in it (under a
// prefix, as a shared bucket would be used).
func startVersitygw(t *testing.T) S3Config {
	t.Helper()
	root := t.TempDir()
	port := freePort(t)
	const access, secret = "cairn-test-access", "cairn-test-secret-key"
	cmd := exec.Command(versitygwBinary(t), "--access", access, "--secret", secret,
		"--port", fmt.Sprintf("127.0.0.1:%d", port), "--quiet", "posix", root)
	logf, err := os.Create(filepath.Join(t.TempDir(), "versitygw.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logf.Close()
		if t.Failed() {
			out, _ := os.ReadFile(logf.Name())
			t.Logf("versitygw log:\n%s", out)
		}
	})
	cfg := S3Config{Endpoint: fmt.Sprintf("http://127.0.0.1:%d", port), Bucket: "backups", Prefix: "cluster-a/",
		Region: "us-east-1", PathStyle: true, AccessKeyID: access, SecretAccessKey: secret}
	client, err := minio.New(fmt.Sprintf("127.0.0.1:%d", port), &minio.Options{
		Creds: credentials.NewStaticV4(access, secret, ""), Region: cfg.Region, BucketLookup: minio.BucketLookupPath})
	if err != nil {
		t.Fatal(err)
	}
	for until := deadline.After(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Second))
		err = client.MakeBucket(ctx, cfg.Bucket, minio.MakeBucketOptions{Region: cfg.Region})
		cancel()
		if err == nil {
			return cfg
		}
		if time.Now().After(until) {
			t.Fatalf("versitygw on port %d did not create a bucket: %v", port, err)
		}
	}
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port
}

// countingTarget passes every call to a real target and counts what is
// written under blocks/ (objects and bytes), so a test can assert what an
// incremental backup uploaded.
type countingTarget struct {
	Target
	puts, bytes atomic.Int64
}

func (c *countingTarget) Put(ctx context.Context, key string, data []byte) error {
	if strings.Contains(key, "/blocks/") {
		c.puts.Add(1)
		c.bytes.Add(int64(len(data)))
	}
	return c.Target.Put(ctx, key, data)
}

func (c *countingTarget) reset() { c.puts.Store(0); c.bytes.Store(0) }

// faultTarget passes calls to a real target, except that calls on keys
// hang is true for block until their context ends (a stuck transfer), and
// the first failures calls of every kind fail with a transient error.
type faultTarget struct {
	Target
	hang     func(key string) bool
	mu       sync.Mutex
	failures int
	calls    int
}

func (f *faultTarget) fault(ctx context.Context, key string) error {
	f.mu.Lock()
	f.calls++
	fail := f.failures > 0
	if fail {
		f.failures--
	}
	f.mu.Unlock()
	if fail {
		return Transient(errors.New("injected: connection reset"))
	}
	if f.hang != nil && f.hang(key) {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

func (f *faultTarget) Put(ctx context.Context, key string, data []byte) error {
	if err := f.fault(ctx, key); err != nil {
		return err
	}
	return f.Target.Put(ctx, key, data)
}

func (f *faultTarget) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	if err := f.fault(ctx, key); err != nil {
		return nil, err
	}
	return f.Target.Get(ctx, key)
}

// listKeys lists every key under prefix.
func listKeys(t *testing.T, tg Target, prefix string) map[string]Object {
	t.Helper()
	keys := map[string]Object{}
	err := tg.List(testCtx(t), prefix, func(o Object) error { keys[o.Key] = o; return nil })
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// testCtx is a context that ends with the test or after a scaled bound.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Minute))
	t.Cleanup(cancel)
	return ctx
}
