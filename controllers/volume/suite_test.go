package volume

import (
	"fmt"
	"os"
	"testing"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/backup"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/engine"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/controllers/snapshot"
	"github.com/cairn-io/cairn/controllers/storagenode"
)

// The suite runs every reconciler against envtest and real instance
// managers, one per simulated node, each starting real engine and replica
// processes on loopback.
var (
	k8sClient client.Client
	testEnv   *suite.Env
	// engines is the running manager's Engine reconciler (its Watches
	// follow the running engines).
	engines *engine.Reconciler
	// volumeReconciler is the running manager's Volume reconciler (its restore
	// slots).
	volumeReconciler *Reconciler
)

// replenishmentWait is short here: long enough for a killed replica
// process to be restarted (well under a second on loopback), short enough
// for a replacement to be built within a test.
const replenishmentWait = 10 * time.Second

func TestMain(m *testing.M) {
	imr := instancemanager.NewReconciler(nil, nil)
	env, err := suite.Start(func(mgr ctrl.Manager, pool *imclient.Pool) error {
		imr.Client, imr.Pool = mgr.GetClient(), pool
		c := mgr.GetClient()
		engines = &engine.Reconciler{Client: c, Pool: pool}
		volumeReconciler = &Reconciler{Client: c, ReplenishmentWait: replenishmentWait}
		for _, setup := range []func(ctrl.Manager) error{
			imr.SetupWithManager,
			(&storagenode.Reconciler{Client: c, Pool: pool, Resync: time.Second}).SetupWithManager,
			(&replica.Reconciler{Client: c, Pool: pool}).SetupWithManager,
			engines.SetupWithManager,
			volumeReconciler.SetupWithManager,
			(&snapshot.Reconciler{Client: c, Pool: pool}).SetupWithManager,
			(&backuptarget.Reconciler{MinRetry: time.Second}).SetupWithManager,
			(&backup.Reconciler{ProgressInterval: 200 * time.Millisecond, RetryBackoff: time.Second}).SetupWithManager,
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
	k8sClient, testEnv = env.Client, env
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
