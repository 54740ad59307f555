// Package harness runs Cairn's whole control plane for tests outside
// controllers/ (the CSI driver's): a real kube-apiserver and etcd
// (envtest) with Cairn's CRDs, a manager running every reconciler, and
// real instance managers on loopback, one per simulated node, starting
// real engine and replica processes.
package harness

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backup"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/controllers/engine"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/controllers/recurringjob"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/controllers/snapshot"
	"github.com/cairn-io/cairn/controllers/storagenode"
	"github.com/cairn-io/cairn/controllers/volume"
)

// Options configure a Cluster.
type Options struct {
	// Namespace holds the Cairn objects; created if missing.
	Namespace string
	// ReplenishmentWait is the Volume reconciler's wait before replacing
	// a failed replica (default 10 s).
	ReplenishmentWait time.Duration
}

// Cluster is a running control plane.
type Cluster struct {
	// Client reads and writes the API server directly (no cache).
	Client    client.Client
	Namespace string
	env       *suite.Env
}

// Start starts envtest and the manager (call it from TestMain; Stop it
// after m.Run).
func Start(opts Options) (*Cluster, error) {
	if opts.Namespace == "" {
		opts.Namespace = "default"
	}
	if opts.ReplenishmentWait == 0 {
		opts.ReplenishmentWait = 10 * time.Second
	}
	imr := instancemanager.NewReconciler(nil, nil)
	// Every volume's engine and replicas authenticate their data
	// connections with the volume's key, as in a cluster.
	keys := certs.MasterKey(bytes.Repeat([]byte("harness!"), 4))
	env, err := suite.Start(func(mgr ctrl.Manager, pool *imclient.Pool) error {
		imr.Client, imr.Pool = mgr.GetClient(), pool
		c := mgr.GetClient()
		for _, setup := range []func(ctrl.Manager) error{
			imr.SetupWithManager,
			(&storagenode.Reconciler{Client: c, Pool: pool, Resync: time.Second}).SetupWithManager,
			(&replica.Reconciler{Client: c, Pool: pool, Keys: keys}).SetupWithManager,
			(&engine.Reconciler{Client: c, Pool: pool, Keys: keys}).SetupWithManager,
			(&volume.Reconciler{Client: c, ReplenishmentWait: opts.ReplenishmentWait, Restore: volume.RestoreOptions{Keys: keys}}).SetupWithManager,
			(&snapshot.Reconciler{Client: c, Pool: pool}).SetupWithManager,
			(&backuptarget.Reconciler{}).SetupWithManager,
			(&backup.Reconciler{}).SetupWithManager,
			(&recurringjob.Reconciler{Client: c}).SetupWithManager,
		} {
			if err := setup(mgr); err != nil {
				return err
			}
		}
		return nil
	}, func(addr string) { imr.Changed(addr) })
	if err != nil {
		return nil, err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: opts.Namespace}}
	if err := env.Client.Create(context.Background(), ns); err != nil && !apierrors.IsAlreadyExists(err) {
		env.Stop()
		return nil, fmt.Errorf("create namespace %s: %w", opts.Namespace, err)
	}
	return &Cluster{Client: env.Client, Namespace: opts.Namespace, env: env}, nil
}

// Stop stops the manager and the API server.
func (c *Cluster) Stop() { c.env.Stop() }

// KubeConfig returns a kubeconfig for an administrator of the API server,
// for a client the tests build themselves (one that watches).
func (c *Cluster) KubeConfig() ([]byte, error) { return c.env.KubeConfig() }

// Node is a simulated node: an instance manager with its own data
// directory (the node's one disk).
type Node struct {
	Name    string
	DataDir string
	im      *imtest.IM
}

// Kill kills the node's instance manager and its processes.
func (n *Node) Kill() { n.im.Kill() }

// AddNode starts an instance manager for a node and creates its
// InstanceManager and StorageNode objects, all removed when t ends.
func (c *Cluster) AddNode(t testing.TB, name string) *Node {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	im := imtest.Start(t, name, "", dir)
	imObj := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-" + name, Namespace: c.Namespace},
		Spec: v1.InstanceManagerSpec{NodeName: name, Address: im.Addr}}
	sn := &v1.StorageNode{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.Namespace}, Spec: v1.StorageNodeSpec{NodeName: name}}
	for _, o := range []client.Object{imObj, sn} {
		if err := c.Client.Create(ctx, o); err != nil {
			t.Fatalf("create %T %s: %v", o, o.GetName(), err)
		}
	}
	t.Cleanup(func() {
		for _, o := range []client.Object{sn, imObj} {
			if err := client.IgnoreNotFound(c.Client.Delete(ctx, o)); err != nil {
				t.Errorf("delete %T %s: %v", o, o.GetName(), err)
			}
		}
	})
	return &Node{Name: name, DataDir: dir, im: im}
}
