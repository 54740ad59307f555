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
var k8sClient client.Client

func TestMain(m *testing.M) {
	env, err := suite.Start(func(ctrl.Manager, *imclient.Pool) error { return nil }, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}
