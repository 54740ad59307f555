package workload

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the workload reconciler, with pod deletion on, against
// envtest: a real API server, where pods are objects no kubelet runs
// (a deleted pod on a node keeps its deletionTimestamp, waiting for one).
var k8sClient client.Client

func TestMain(m *testing.M) {
	env, err := suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		return (&Reconciler{Client: mgr.GetClient(), Namespace: volumeNamespace, DeletePods: true}).SetupWithManager(mgr)
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
