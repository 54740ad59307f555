package claims

import (
	"fmt"
	"os"
	"testing"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the forwarder against envtest (a real API server) with
// a short attach wait. Volumes, PersistentVolumes, claims and pods are
// objects the tests write, statuses included, as the Volume reconciler,
// the CSI provisioner and the scheduler would.
var k8sClient client.Client

// testAttachWait is the forwarder's attach wait in these tests.
const testAttachWait = 2 * time.Second

// volumeNamespace holds the Volumes the suite's forwarder watches.
const volumeNamespace = "cairn-system"

func TestMain(m *testing.M) {
	env, err := suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		return (&Forwarder{Namespace: volumeNamespace, AttachWait: testAttachWait}).SetupWithManager(mgr)
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
