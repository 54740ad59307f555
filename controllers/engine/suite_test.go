package engine

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/controllers/replica"
)

// The suite runs the Engine, Replica and InstanceManager reconcilers
// against envtest and real instance managers.
var (
	k8sClient client.Client
	pool      *imclient.Pool
)

func TestMain(m *testing.M) {
	imr := instancemanager.NewReconciler(nil, nil)
	env, err := suite.Start(func(mgr ctrl.Manager, p *imclient.Pool) error {
		imr.Client, imr.Pool = mgr.GetClient(), p
		c := mgr.GetClient()
		for _, setup := range []func(ctrl.Manager) error{
			imr.SetupWithManager,
			(&replica.Reconciler{Client: c, Pool: p}).SetupWithManager,
			(&Reconciler{Client: c, Pool: p}).SetupWithManager,
		} {
			if err := setup(mgr); err != nil {
				return err
			}
		}
		return nil
	}, func(addr string) { imr.Changed(addr) })
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient, pool = env.Client, env.Pool
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
