package csi

import (
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
)

// TestSanity runs the csi-sanity suite in process against the driver on
// node-a of a three-node control plane, mounting for real. Skipped specs
// are listed in docs/csi.md with the reason.
func TestSanity(t *testing.T) {
	needRoot(t)
	for _, n := range []string{"sanity-a", "sanity-b", "sanity-c"} {
		cluster.AddNode(t, n)
	}
	d := startDriver(t, "sanity-a")
	dir := t.TempDir()
	cfg := sanity.NewTestConfig()
	cfg.Address = d.sock
	cfg.TargetPath = filepath.Join(dir, "target")
	cfg.StagingPath = filepath.Join(dir, "staging")
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.TestVolumeParameters = map[string]string{ParamNumberOfReplicas: "2"}
	cfg.IdempotentCount = 2
	sanity.Test(t, cfg)
}
