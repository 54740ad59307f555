package backupstore

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

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
	NFS NFSConfig
}

func (c childTarget) open() (Target, error) {
	if c.Dir != "" {
		return NewDirTarget(c.Dir)
	}
	if c.NFS.Server != "" {
		return NewNFSTarget(c.NFS)
	}
	return NewS3Target(c.S3)
}

// targetKinds: a directory (as an NFS export would be mounted), a real
// S3 server (versitygw with its posix backend on a temporary directory)
// and a real NFSv3 server (go-nfs over a temporary directory) spoken to
// by the user-space NFS client.
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
		{"nfs", func(t *testing.T) (Target, childTarget) {
			cfg := startNFSServer(t, nfsserver.Options{})
			tg, err := NewNFSTarget(cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = tg.Close() })
			return tg, childTarget{NFS: cfg}
		}},
	}
}

// startNFSServer runs go-nfs over a temporary directory and returns the
// config of a target in it (under a prefix, as a shared export would be
// used).
func startNFSServer(t *testing.T, opts nfsserver.Options) NFSConfig {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = t.TempDir()
	}
	srv, err := nfsserver.Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return NFSConfig{Server: srv.Host, Export: srv.Export, Prefix: "cluster-a/", MountPort: srv.Port, NFSPort: srv.Port}
}

// startVersitygw runs versitygw over a temporary directory with a
// bucket and returns the config of a target in it (under a prefix, as a
// shared bucket would be used).
func startVersitygw(t *testing.T) S3Config {
	t.Helper()
	srv, err := versitygw.Start(versitygw.Options{Dir: t.TempDir(), Bucket: "backups"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Stop()
		if t.Failed() {
			t.Logf("versitygw log:\n%s", srv.Log())
		}
	})
	return S3Config{Endpoint: srv.Endpoint, Bucket: "backups", Prefix: "cluster-a/", Region: versitygw.Region,
		PathStyle: true, AccessKeyID: versitygw.AccessKey, SecretAccessKey: versitygw.SecretKey}
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
