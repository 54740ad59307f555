package backup

import (
	"fmt"
	"os"
	"testing"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
	"github.com/cairn-io/cairn/dataplane/testutil/versitygw"
)

// The tests run the reconciler (and the Snapshot reconciler) one
// reconcile at a time against a real API server (envtest), with the
// Volume, Engine and Replica objects written as their reconcilers would,
// a real engine over real replica processes' servers in process, and a
// real S3 server (versitygw).
var (
	k8sClient client.Client
	gw        *versitygw.Server
	env       *suite.Env
	// managed, when set, registers reconcilers in the manager
	// (TestManagerRunsBackups); the other tests call Reconcile themselves.
	managed func(ctrl.Manager) error
)

const bucket = "backups"

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	tmp, err := os.MkdirTemp("", "backup-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	gw, err = versitygw.Start(versitygw.Options{Dir: tmp, Bucket: bucket})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer gw.Stop()
	env, err = suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error {
		if managed != nil {
			return managed(mgr)
		}
		return nil
	}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer env.Stop()
	k8sClient = env.Client
	return m.Run()
}
