package secretguard

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/yaml"

	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/suite"
)

// The suite runs the guard against envtest (a real API server) with the
// permissions cairn-manager is deployed with: the guard's manager acts as
// a user bound to config/rbac/role.yaml (as generated from the markers),
// so a verb the markers lack fails the tests. envtest runs no controllers
// of its own: the API server puts pv-protection on every PersistentVolume
// and nothing lifts it (the tests do), and a namespace deleted stays. The
// external-snapshotter's CRDs (VolumeSnapshot, VolumeSnapshotContent,
// VolumeSnapshotClass) are installed before the guard starts, from the
// client module of the version Cairn deploys (snapshotterVersion);
// TestStartsWithoutSnapshotCRDs runs an API server of its own without them.
var (
	k8sClient client.Client
	env       *suite.Env
)

// guardUser is who the guard acts as.
const guardUser = "cairn-secret-guard-test"

func TestMain(m *testing.M) {
	var err error
	env, err = suite.Start(func(mgr ctrl.Manager, _ *imclient.Pool) error { return runWithManagerRole(mgr) }, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	k8sClient = env.Client
	code := m.Run()
	env.Stop()
	os.Exit(code)
}

// runWithManagerRole binds guardUser to the manager's ClusterRole and
// runs the guard in a manager of its own that impersonates guardUser,
// started and stopped with mgr (the suite's manager, an administrator).
func runWithManagerRole(mgr ctrl.Manager) error {
	if err := bindManagerRole(mgr); err != nil {
		return err
	}
	if err := installSnapshotCRDs(mgr.GetConfig()); err != nil {
		return err
	}
	cfg := rest.CopyConfig(mgr.GetConfig())
	cfg.Impersonate = rest.ImpersonationConfig{UserName: guardUser}
	inner, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: mgr.GetScheme(), Metrics: metricsserver.Options{BindAddress: "0"},
		Controller: config.Controller{SkipNameValidation: ptr.To(true)}})
	if err != nil {
		return err
	}
	if err := (&Reconciler{}).SetupWithManager(inner); err != nil {
		return err
	}
	return mgr.Add(manager.RunnableFunc(inner.Start))
}

// snapshotterVersion is the external-snapshotter whose CRDs the tests
// install: the csi-snapshotter of config/csi/controller.yaml and the
// Makefile's SNAPSHOTTER_VERSION.
const snapshotterVersion = "v8.7.0"

// installSnapshotCRDs installs the snapshot CRDs of snapshotterVersion's
// client module, found as `make deploy-snapshot-controller` finds them
// (go mod download, which reads the module cache first).
func installSnapshotCRDs(cfg *rest.Config) error {
	out, err := exec.Command("go", "mod", "download", "-json", "github.com/kubernetes-csi/external-snapshotter/client/v8@"+snapshotterVersion).Output()
	if err != nil {
		return fmt.Errorf("find the external-snapshotter client module %s: %w", snapshotterVersion, err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil {
		return fmt.Errorf("read go mod download's answer %q: %w", out, err)
	}
	if mod.Dir == "" {
		return fmt.Errorf("go mod download named no directory for the external-snapshotter client module: %q", out)
	}
	var paths []string
	for _, kind := range []string{"volumesnapshotclasses", "volumesnapshotcontents", "volumesnapshots"} {
		paths = append(paths, filepath.Join(mod.Dir, "config", "crd", "snapshot.storage.k8s.io_"+kind+".yaml"))
	}
	_, err = envtest.InstallCRDs(cfg, envtest.CRDInstallOptions{Paths: paths, ErrorIfPathMissing: true})
	return err
}

// bindManagerRole creates config/rbac/role.yaml's ClusterRole and binds
// guardUser to it (both kept across manager restarts).
func bindManagerRole(mgr ctrl.Manager) error {
	admin, err := client.New(mgr.GetConfig(), client.Options{Scheme: mgr.GetScheme()})
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "rbac", "role.yaml"))
	if err != nil {
		return err
	}
	role := &rbacv1.ClusterRole{}
	if err := yaml.Unmarshal(raw, role); err != nil {
		return fmt.Errorf("config/rbac/role.yaml: %w", err)
	}
	role.Name = "cairn-manager-role"
	ctx := context.Background()
	if err := client.IgnoreAlreadyExists(admin.Create(ctx, role)); err != nil {
		return err
	}
	binding := &rbacv1.ClusterRoleBinding{
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: guardUser}},
	}
	binding.Name = guardUser
	return client.IgnoreAlreadyExists(admin.Create(ctx, binding))
}
