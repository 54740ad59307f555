package csi

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/harness"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// The tests run the driver against the whole control plane: envtest, the
// manager with every reconciler, and real instance managers on loopback
// whose engines serve real loop devices (the fuse frontend), which the
// node service formats and mounts for real (as root).
var cluster *harness.Cluster

const testNamespace = "cairn-system"

func TestMain(m *testing.M) {
	c, err := harness.Start(harness.Options{Namespace: testNamespace})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	cluster = c
	code := m.Run()
	c.Stop()
	os.Exit(code)
}

// needRoot skips a test that mounts, formats or uses loop devices.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: formats and mounts loop devices")
	}
}

// addNodes adds simulated nodes and waits until each reports a disk with
// free space: CreateVolume fails at once (ResourceExhausted) when no disk
// can take a replica, and a node's disk is reported a moment after its
// instance manager starts.
func addNodes(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		cluster.AddNode(t, n)
	}
	g := NewWithT(t)
	for _, n := range names {
		// The failure names what the StorageNode said last (its
		// conditions and disks), the cause a bare false would hide.
		g.Eventually(func(g Gomega) {
			var sn v1.StorageNode
			g.Expect(cluster.Client.Get(context.Background(), client.ObjectKey{Namespace: testNamespace, Name: n}, &sn)).To(Succeed())
			ok := false
			for _, d := range sn.Status.Disks {
				ok = ok || (d.Available != nil && d.Available.Sign() > 0)
			}
			g.Expect(ok).To(BeTrue(), "node %s reports a disk with free space; its status: conditions %+v, disks %+v", n, sn.Status.Conditions, sn.Status.Disks)
		}, deadline.Scale(2*time.Minute), 100*time.Millisecond).Should(Succeed())
	}
}

// driver is a running driver on a unix socket, and clients of it.
type driver struct {
	*Driver
	sock       string
	conn       *grpc.ClientConn
	identity   csipb.IdentityClient
	controller csipb.ControllerClient
	node       csipb.NodeClient
}

// startDriver serves a driver (every service, node service on node) on a
// socket in a fresh directory until t ends.
func startDriver(t *testing.T, node string) *driver {
	t.Helper()
	return serveDriver(t, Options{Mode: ModeAll, NodeID: node})
}

// serveDriver serves a driver with opts (version, client, namespace and
// logger filled in) on a socket in a fresh directory until t ends.
func serveDriver(t *testing.T, opts Options) *driver {
	t.Helper()
	opts.Version, opts.Client, opts.Namespace, opts.Logger = "test", cluster.Client, testNamespace, logr.Discard()
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "cairn-csi-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "csi.sock")
	l, err := Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := d.NewServer()
	go func() { _ = srv.Serve(l) }() // nil after Stop at cleanup; a failure shows as the calls failing
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &driver{Driver: d, sock: sock, conn: conn, identity: csipb.NewIdentityClient(conn),
		controller: csipb.NewControllerClient(conn), node: csipb.NewNodeClient(conn)}
}

// callCtx bounds one CSI call as the sidecars do.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(2*time.Minute))
	t.Cleanup(cancel)
	return ctx
}

var _ net.Listener
