package ui

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The page is rendered from objects a real API server (envtest) holds:
// the tests write them, statuses included, as the reconcilers would.
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
