package csi

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
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

// TestSanity runs the csi-sanity suite in process against the driver
// serving every service on node-a of a three-node control plane, mounting
// for real. Skipped specs are listed in docs/csi.md with the reason.
func TestSanity(t *testing.T) {
	needRoot(t)
	for _, n := range []string{"sanity-a", "sanity-b", "sanity-c"} {
		cluster.AddNode(t, n)
	}
	d := startDriver(t, "sanity-a")
	sanity.Test(t, *sanityConfig(t, d.sock, d.sock, nil))
}

// TestSanitySplit runs csi-sanity against the driver as it is deployed:
// the node plugin (node mode) on one socket, the controller plugin
// (controller mode) on another, mounting for real. csi-sanity reads the
// node plugin's GetPluginCapabilities to decide whether to
// controller-publish a volume before its node tests stage it.
func TestSanitySplit(t *testing.T) {
	needRoot(t)
	for _, n := range []string{"split-a", "split-b"} {
		cluster.AddNode(t, n)
	}
	node := serveDriver(t, Options{Mode: ModeNode, NodeID: "split-a"})
	ctrl := serveDriver(t, Options{Mode: ModeController})
	sanity.Test(t, *sanityConfig(t, node.sock, ctrl.sock, nil))
}

// TestSanityFakeMounts runs csi-sanity against the split deployment
// without root: the node plugin's mounts are kept in memory (fakeMounter)
// and volumes are served by their engines' NBD sockets (the nbd frontend
// on a node without the nbd kernel module), so everything but the kernel's
// mount table and mkfs is real. As root the two tests above cover the
// node service with real mounts, and this one is skipped.
func TestSanityFakeMounts(t *testing.T) {
	if os.Geteuid() == 0 {
		t.Skip("root runs TestSanity and TestSanitySplit, which mount for real")
	}
	for _, n := range []string{"fake-a", "fake-b"} {
		cluster.AddNode(t, n)
	}
	node := serveDriver(t, Options{Mode: ModeNode, NodeID: "fake-a", Mounter: newFakeMounter()})
	ctrl := serveDriver(t, Options{Mode: ModeController})
	sanity.Test(t, *sanityConfig(t, node.sock, ctrl.sock, map[string]string{ParamFrontend: "nbd"}))
}
