package snapshot

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The tests run the reconciler one reconcile at a time against a real API
// server (envtest), with the Volume and Engine objects written as their
// reconcilers would, and a real engine over real replicas in process.
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
