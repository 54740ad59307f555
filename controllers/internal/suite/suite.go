// Package suite starts what a reconciler package's tests run against: a
// real kube-apiserver and etcd (envtest) with Cairn's CRDs, and a manager
// running the reconcilers the package sets up.
package suite

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
)

// Env is a running test environment.
type Env struct {
	Client client.Client
	Pool   *imclient.Pool
	stop   func()
}

// Stop stops the manager, the pool and the API server.
func (e *Env) Stop() { e.stop() }

// Start starts envtest and a manager; setup registers the reconcilers
// (given the manager and a pool whose OnChange calls onChange, if set).
func Start(setup func(mgr ctrl.Manager, pool *imclient.Pool) error, onChange func(string)) (*Env, error) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		return nil, errors.New("KUBEBUILDER_ASSETS is not set, so envtest cannot find kube-apiserver and etcd: run `make test`, or export KUBEBUILDER_ASSETS=$(hack/envtest.sh)")
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	_, file, _, _ := goruntime.Caller(0)
	crds := filepath.Join(filepath.Dir(file), "..", "..", "..", "config", "crd", "bases")
	env := &envtest.Environment{CRDDirectoryPaths: []string{crds}, ErrorIfCRDPathMissing: true, Scheme: scheme}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("start envtest: %w", err)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: scheme, Metrics: metricsserver.Options{BindAddress: "0"}})
	if err != nil {
		env.Stop()
		return nil, err
	}
	pool := imclient.New(imclient.Options{OnChange: func(addr string) {
		if onChange != nil {
			onChange(addr)
		}
	}})
	if err := setup(mgr, pool); err != nil {
		pool.Close()
		env.Stop()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "manager stopped:", err)
		}
	}()
	// Tests read through their own client, not the manager's cache, so
	// what they created is there at once.
	direct, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		cancel()
		<-done
		pool.Close()
		env.Stop()
		return nil, err
	}
	return &Env{Client: direct, Pool: pool, stop: func() {
		cancel()
		<-done
		pool.Close()
		env.Stop()
	}}, nil
}
