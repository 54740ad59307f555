package instancemanager

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the reconciler in a manager against a real kube-apiserver
// and etcd (envtest) and real instance managers.
var k8sClient client.Client

func TestMain(m *testing.M) {
	r := NewReconciler(nil, nil)
	env, err := suite.Start(func(mgr ctrl.Manager, pool *imclient.Pool) error {
		r.Client, r.Pool = mgr.GetClient(), pool
		if err := (&PodDiscovery{Client: mgr.GetClient(), Namespace: "default"}).SetupWithManager(mgr); err != nil {
			return err
		}
		if err := (&PodGate{Client: mgr.GetClient(), Namespace: "default"}).SetupWithManager(mgr); err != nil {
			return err
		}
		return r.SetupWithManager(mgr)
	}, func(addr string) { r.Changed(addr) })
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
