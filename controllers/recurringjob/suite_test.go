package recurringjob

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The tests run the reconciler one reconcile at a time, on a clock they
// move, against a real API server (envtest). The Snapshot reconciler is
// run by hand beside it over real engines and replicas in process, so
// the Snapshots a job makes are really taken and really deleted.
var (
	k8sClient client.Client
	env       *suite.Env
	// managed, when set, registers reconcilers in the manager at its
	// next start (TestManagerRunsJob); otherwise it runs none.
	managed func(ctrl.Manager) error
)

func TestMain(m *testing.M) {
	var err error
	env, err = suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		if managed != nil {
			return managed(mgr)
		}
		return nil
	}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
