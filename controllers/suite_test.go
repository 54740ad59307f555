package controllers

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	storagev1alpha1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// The schema suite runs against a real kube-apiserver and etcd started by
// envtest, with the CRDs from config/crd/bases installed.
var (
	testEnv   *envtest.Environment
	k8sClient client.Client
	restCfg   *rest.Config
	ctx       = context.Background()
)

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	// Not a skip: without a real API server this suite proves nothing, so a
	// missing toolchain is a failure with the fix in the message.
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		fmt.Fprintln(os.Stderr, "controllers: KUBEBUILDER_ASSETS is not set, so envtest cannot find kube-apiserver, etcd and kubectl.\n"+
			"Run `make test`, or: export KUBEBUILDER_ASSETS=$(hack/envtest.sh)")
		return 1
	}
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme, apiextensionsv1.AddToScheme, storagev1alpha1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			fmt.Fprintln(os.Stderr, "controllers: build scheme:", err)
			return 1
		}
	}
	testEnv = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		Scheme:                scheme,
		// A loaded machine starts kube-apiserver in more than envtest's
		// default minute.
		ControlPlaneStartTimeout: deadline.Scale(3 * time.Minute),
	}
	cfg, err := testEnv.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, "controllers: start envtest:", err)
		return 1
	}
	defer func() {
		if err := testEnv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "controllers: stop envtest:", err)
		}
	}()
	restCfg = cfg
	k8sClient, err = client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		fmt.Fprintln(os.Stderr, "controllers: create client:", err)
		return 1
	}
	return m.Run()
}
