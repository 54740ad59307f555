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
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// Env is a running test environment.
type Env struct {
	Client client.Client
	// Pool is the running manager's instance-manager pool.
	Pool *imclient.Pool

	cfg      *rest.Config
	scheme   *runtime.Scheme
	env      *envtest.Environment
	setup    func(mgr ctrl.Manager, pool *imclient.Pool) error
	onChange func(string)

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

// Stop stops the manager, the pool and the API server.
func (e *Env) Stop() {
	e.StopManager()
	if err := e.env.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "stop envtest:", err)
	}
}

// Start starts envtest and a manager; setup registers the reconcilers
// (given the manager and a pool whose OnChange calls onChange, if set).
func Start(setup func(mgr ctrl.Manager, pool *imclient.Pool) error, onChange func(string)) (*Env, error) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		return nil, errors.New("KUBEBUILDER_ASSETS is not set, so envtest cannot find kube-apiserver and etcd: run `make test`, or export KUBEBUILDER_ASSETS=$(hack/envtest.sh)")
	}
	// The reconcilers' own logs are not needed here; tests assert on
	// objects, processes and bytes.
	ctrl.SetLogger(logr.Discard())
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	_, file, _, _ := goruntime.Caller(0)
	crds := filepath.Join(filepath.Dir(file), "..", "..", "..", "config", "crd", "bases")
	// A loaded machine (load average 50 was seen) starts kube-apiserver in
	// more than envtest's default minute.
	env := &envtest.Environment{CRDDirectoryPaths: []string{crds}, ErrorIfCRDPathMissing: true, Scheme: scheme,
		ControlPlaneStartTimeout: deadline.Scale(3 * time.Minute), ControlPlaneStopTimeout: deadline.Scale(time.Minute)}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("start envtest: %w", err)
	}
	// Tests read through their own client, not the manager's cache, so
	// what they created is there at once.
	direct, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, errors.Join(err, env.Stop())
	}
	e := &Env{Client: direct, cfg: cfg, scheme: scheme, env: env, setup: setup, onChange: onChange}
	if err := e.StartManager(); err != nil {
		return nil, errors.Join(err, env.Stop())
	}
	return e, nil
}

// KubeConfig returns a kubeconfig for an administrator of the API server,
// for a manager run as its own process.
func (e *Env) KubeConfig() ([]byte, error) {
	u, err := e.env.AddUser(envtest.User{Name: "cairn-manager", Groups: []string{"system:masters"}}, e.cfg)
	if err != nil {
		return nil, err
	}
	return u.KubeConfig()
}

// StartManager starts a new manager, with a new pool, running the
// reconcilers setup registers: what a restarted cairn-manager is.
func (e *Env) StartManager() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cancel != nil {
		return errors.New("the manager is already running")
	}
	mgr, err := ctrl.NewManager(e.cfg, ctrl.Options{Scheme: e.scheme, Metrics: metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	if err != nil {
		return err
	}
	pool := imclient.New(imclient.Options{OnChange: func(addr string) {
		if e.onChange != nil {
			e.onChange(addr)
		}
	}})
	if err := e.setup(mgr, pool); err != nil {
		pool.Close()
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "manager stopped:", err)
		}
		pool.Close()
	}()
	e.Pool, e.cancel, e.done = pool, cancel, done
	return nil
}

// StopManager stops the manager and its pool (the instance managers and
// their processes go on), and returns once they have stopped.
func (e *Env) StopManager() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.cancel == nil {
		return
	}
	e.cancel()
	<-e.done
	e.cancel, e.done = nil, nil
}
