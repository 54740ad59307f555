package csi

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
)

// sanityConfig is csi-sanity's configuration for a driver whose node
// service listens on nodeSock and controller service on ctrlSock (the
// same socket for a driver serving both).
func sanityConfig(t *testing.T, nodeSock, ctrlSock string, params map[string]string) *sanity.TestConfig {
	dir := t.TempDir()
	cfg := sanity.NewTestConfig()
	cfg.Address = nodeSock
	if ctrlSock != nodeSock {
		cfg.ControllerAddress = ctrlSock
	}
	cfg.TargetPath = filepath.Join(dir, "target")
	cfg.StagingPath = filepath.Join(dir, "staging")
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.TestVolumeParameters = map[string]string{ParamNumberOfReplicas: "2"}
	for k, v := range params {
		cfg.TestVolumeParameters[k] = v
	}
	cfg.IdempotentCount = 2
	return &cfg
}

// sanityDeployment is one way of deploying the driver that csi-sanity
// runs against.
type sanityDeployment struct {
	name string
	cfg  *sanity.TestConfig
}

// TestSanity runs the csi-sanity suite in process. As root, against two
// deployments on a three-node control plane, mounting for real: one
// plugin serving every service on one socket, and the deployed shape, the
// node plugin (node mode) and the controller plugin (controller mode) on
// two sockets. csi-sanity reads the node plugin's GetPluginCapabilities
// to decide whether to controller-publish a volume before its node tests
// stage it, so the split run checks the two plugins agree. Without root,
// against the split deployment with the node plugin's mounts kept in
// memory (fakeMounter) and volumes served by their engines' NBD sockets
// (the nbd frontend on a node without the nbd kernel module), so that a
// plain `go test` exercises the node service too. Ginkgo runs one suite
// per process, so the deployments are parts of one suite. Skipped specs
// are listed in docs/csi.md with the reason.
func TestSanity(t *testing.T) {
	var deployments []sanityDeployment
	if os.Geteuid() == 0 {
		addNodes(t, "sanity-a", "sanity-b", "sanity-c")
		all := startDriver(t, "sanity-a")
		node := serveDriver(t, Options{Mode: ModeNode, NodeID: "sanity-b"})
		ctrl := serveDriver(t, Options{Mode: ModeController})
		deployments = []sanityDeployment{
			{name: "one plugin serving every service", cfg: sanityConfig(t, all.sock, all.sock, nil)},
			{name: "node and controller plugins apart", cfg: sanityConfig(t, node.sock, ctrl.sock, nil)},
		}
	} else {
		t.Log("not root: the node plugin's mounts are kept in memory; TestSanity as root mounts for real")
		addNodes(t, "sanity-a", "sanity-b")
		node := serveDriver(t, Options{Mode: ModeNode, NodeID: "sanity-a", Mounter: newFakeMounter()})
		ctrl := serveDriver(t, Options{Mode: ModeController})
		deployments = []sanityDeployment{{name: "node and controller plugins apart, mounts in memory",
			cfg: sanityConfig(t, node.sock, ctrl.sock, map[string]string{ParamFrontend: "nbd"})}}
	}
	var contexts []*sanity.TestContext
	for _, d := range deployments {
		ginkgo.Describe(d.name, func() { contexts = append(contexts, sanity.GinkgoTest(d.cfg)) })
	}
	gomega.RegisterFailHandler(ginkgo.Fail)
	ginkgo.RunSpecs(t, "csi-sanity")
	for _, sc := range contexts {
		sc.Finalize()
	}
}
