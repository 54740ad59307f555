package replica

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the Replica and InstanceManager reconcilers against
// envtest and real instance managers.
var k8sClient client.Client

func TestMain(m *testing.M) {
	imr := instancemanager.NewReconciler(nil, nil)
	env, err := suite.Start(func(mgr ctrl.Manager, pool *imclient.Pool) error {
		imr.Client, imr.Pool = mgr.GetClient(), pool
		if err := imr.SetupWithManager(mgr); err != nil {
			return err
		}
		return (&Reconciler{Client: mgr.GetClient(), Pool: pool}).SetupWithManager(mgr)
	}, func(addr string) { imr.Changed(addr) })
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
