package drain

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the drain reconciler against envtest: a real API server,
// whose eviction API honours PodDisruptionBudgets. No Volume, Engine or
// Replica reconciler runs: the tests write what they would report (an
// engine's replica modes, a replacement turning RW).
var k8sClient client.Client

const guardImage = "registry.example/cairn-manager:test"

func TestMain(m *testing.M) {
	env, err := suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		return (&Reconciler{Client: mgr.GetClient(), GuardImage: guardImage}).SetupWithManager(mgr)
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
