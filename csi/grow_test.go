package csi

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// TestExtGrowRule checks what Filesystem predicts an ext4 grows to against
// what e2fsck and resize2fs make of it, on image files (no root): the
// prediction decides whether NodeStageVolume runs them, so a device a
// little larger than its filesystem (a last block group too small to keep)
// must not count as room to grow, and every larger one must.
func TestExtGrowRule(t *testing.T) {
	m := NewSystemMounter()
	for _, tc := range []struct {
		name        string
		size, grown int64
	}{
		{name: "1k blocks, a whole group more", size: 64 << 20, grown: 72 << 20},
		{name: "1k blocks, a partial group", size: 64 << 20, grown: 64<<20 + 3<<20},
		{name: "1k blocks, too little for a group", size: 64 << 20, grown: 64<<20 + 256<<10},
		{name: "1k blocks, no change", size: 64 << 20, grown: 64 << 20},
		{name: "4k blocks, too little for a group", size: 1 << 30, grown: 1<<30 + 1<<20},
		// Group 8 of a 1 GiB ext4 keeps no superblock backup: it needs 2
		// bitmaps, 512 inode-table blocks and 50 more.
		{name: "4k blocks, one block short of a group", size: 1 << 30, grown: 1<<30 + 563*4096},
		{name: "4k blocks, just enough for a group", size: 1 << 30, grown: 1<<30 + 564*4096},
		{name: "4k blocks, much more", size: 1 << 30, grown: 3 << 30},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			img := filepath.Join(t.TempDir(), "disk.img")
			g.Expect(os.Truncate(mustCreate(g, img), tc.size)).To(Succeed())
			runTool(g, "mkfs.ext4", "-q", "-F", "-m0", img)
			fs, err := m.Filesystem(img)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(fs.Type).To(Equal("ext4"))
			g.Expect(fs.Size).To(Equal(tc.size), "mkfs fills a device of whole groups")
			g.Expect(fs.CanGrow()).To(BeFalse())

			g.Expect(os.Truncate(img, tc.grown)).To(Succeed())
			fs, err = m.Filesystem(img)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(m.Grow(img, "", fs)).To(Succeed())
			grown, err := m.Filesystem(img)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(grown.Size).To(Equal(fs.GrowsTo), "predicted %d, resize2fs made %d", fs.GrowsTo, grown.Size)
			g.Expect(grown.CanGrow()).To(BeFalse())
			runTool(g, "e2fsck", "-f", "-n", img) // the grown filesystem is consistent
		})
	}
}

// TestGrowOnLoopDevices grows real filesystems on loop devices the way
// the node service does: an ext4 unmounted (no capability needed), an xfs
// mounted; then each mounted, where an ext4 needs CAP_SYS_RESOURCE: where
// this process lacks it, Grow says so and changes nothing. Each xfs
// prediction is checked against what xfs_growfs makes of it, a last
// allocation group too small to keep included.
func TestGrowOnLoopDevices(t *testing.T) {
	needRoot(t)
	m := NewSystemMounter()
	const size = 300 << 20 // xfs wants at least 300 MiB
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			g := NewWithT(t)
			dir := t.TempDir()
			img, mnt := filepath.Join(dir, "disk.img"), filepath.Join(dir, "mnt")
			g.Expect(os.Mkdir(mnt, 0o750)).To(Succeed())
			g.Expect(os.Truncate(mustCreate(g, img), size)).To(Succeed())
			dev := loopDevice(t, g, img)
			g.Expect(m.FormatAndMount(dev, mnt, fsType, nil)).To(Succeed())
			g.Expect(m.Unmount(mnt)).To(Succeed())

			grow := func(to int64) Filesystem {
				g.Expect(os.Truncate(img, to)).To(Succeed())
				runTool(g, "losetup", "-c", dev)
				n, err := m.DeviceSize(dev)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(n).To(Equal(to))
				fs, err := m.Filesystem(dev)
				g.Expect(err).NotTo(HaveOccurred())
				return fs
			}
			fs := grow(size + 64<<20)
			g.Expect(fs.CanGrow()).To(BeTrue())
			if fsType == "ext4" {
				g.Expect(m.Grow(dev, "", fs)).To(Succeed())
				g.Expect(m.FormatAndMount(dev, mnt, fsType, nil)).To(Succeed())
			} else {
				g.Expect(m.Grow(dev, "", fs)).To(MatchError(ErrCannotGrow), "an xfs grows only mounted")
				g.Expect(m.FormatAndMount(dev, mnt, fsType, nil)).To(Succeed())
				g.Expect(m.Grow(dev, mnt, fs)).To(Succeed())
			}
			g.Expect(m.Unmount(mnt)).To(Succeed())
			grown, err := m.Filesystem(dev)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(grown.Size).To(Equal(fs.GrowsTo))
			g.Expect(grown.Size).To(BeNumerically(">", fs.Size))

			if fsType == "xfs" {
				// Room for a last allocation group too small to keep, then
				// for one just large enough.
				for _, extra := range []int64{xfsMinAGBlocks / 2, 2 * xfsMinAGBlocks} {
					bs := grown.Size / int64(mustXFS(g, dev).blocks)
					fs := grow(grown.Size + extra*bs)
					g.Expect(m.FormatAndMount(dev, mnt, fsType, nil)).To(Succeed())
					g.Expect(m.Grow(dev, mnt, fs)).To(Succeed())
					g.Expect(m.Unmount(mnt)).To(Succeed())
					grown, err = m.Filesystem(dev)
					g.Expect(err).NotTo(HaveOccurred())
					g.Expect(grown.Size).To(Equal(fs.GrowsTo), "%d blocks more: predicted %d, xfs_growfs made %d", extra, fs.GrowsTo, grown.Size)
				}
			}

			t.Log("grow mounted")
			fs = grow(grown.Size + 64<<20)
			g.Expect(m.FormatAndMount(dev, mnt, fsType, nil)).To(Succeed())
			err = m.Grow(dev, mnt, fs)
			g.Expect(m.Unmount(mnt)).To(Succeed())
			after, ferr := m.Filesystem(dev)
			g.Expect(ferr).NotTo(HaveOccurred())
			if fsType == "ext4" && !hasCapSysResource() {
				t.Log("this process lacks CAP_SYS_RESOURCE: a mounted ext4 does not grow, and Grow says why")
				g.Expect(err).To(MatchError(ErrNeedCapSysResource))
				g.Expect(after.Size).To(Equal(fs.Size), "nothing changed")
			} else {
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(after.Size).To(Equal(fs.GrowsTo))
			}
			if fsType == "ext4" {
				runTool(g, "e2fsck", "-f", "-n", dev)
			} else {
				runTool(g, "xfs_repair", "-n", dev)
			}
		})
	}
}

// TestStageGrowsFilesystem: a volume whose device is larger than its
// filesystem when it is staged comes back with the filesystem grown to
// fill it, data intact: a volume expanded while detached, a snapshot
// restored into a larger volume, a volume cloned into a larger one. As the
// filesystem grows before it is mounted (ext4) or right after (xfs),
// none of this needs CAP_SYS_RESOURCE.
func TestStageGrowsFilesystem(t *testing.T) {
	needRoot(t)
	addNodes(t, "grow-a", "grow-b")
	ctrl := serveDriver(t, Options{Mode: ModeController})
	node := serveDriver(t, Options{Mode: ModeNode, NodeID: "grow-a"})
	const size = 300 << 20 // xfs wants at least 300 MiB
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			g := NewWithT(t)
			ctx := callCtx(t)
			vc := volCap(fsType, false)
			create := func(name string, size int64, src *csipb.VolumeContentSource) *csipb.Volume {
				r, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: name + "-" + fsType,
					CapacityRange: &csipb.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csipb.VolumeCapability{vc},
					Parameters: map[string]string{ParamNumberOfReplicas: "2"}, VolumeContentSource: src})
				g.Expect(err).NotTo(HaveOccurred())
				t.Cleanup(func() {
					_, _ = ctrl.controller.DeleteVolume(context.Background(), &csipb.DeleteVolumeRequest{VolumeId: r.GetVolume().GetVolumeId()})
				})
				return r.GetVolume()
			}
			// expectFills checks the pod sees a filesystem of about the
			// volume's size (its own metadata taken off) and the data.
			expectFills := func(p *pod, volSize int64, data []chunk) {
				t.Helper()
				g.Expect(usableBytes(g, p)).To(BeNumerically(">", volSize*85/100), "the filesystem fills the %d-byte volume", volSize)
				g.Expect(readData(t, g, p, data)).To(Succeed())
			}

			vol := create("grow", size, nil)
			p := mountOn(t, g, ctrl, node, vol, vc)
			data := writeData(t, g, p, "kept")
			small := usableBytes(g, p)
			g.Expect(small).To(BeNumerically("<", size))
			unmountFrom(t, g, ctrl, p, vol.GetVolumeId())

			t.Log("expanded while detached")
			const larger = size + 128<<20
			_, err := ctrl.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
				CapacityRange: &csipb.CapacityRange{RequiredBytes: larger}, VolumeCapability: vc})
			g.Expect(err).NotTo(HaveOccurred())
			p = mountOn(t, g, ctrl, node, vol, vc)
			expectFills(p, larger, data)
			g.Expect(usableBytes(g, p)).To(BeNumerically(">=", small+100<<20))
			unmountFrom(t, g, ctrl, p, vol.GetVolumeId())

			t.Log("a snapshot restored into a larger volume")
			snap, err := ctrl.controller.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{Name: "snapshot-grow-" + fsType, SourceVolumeId: vol.GetVolumeId()})
			g.Expect(err).NotTo(HaveOccurred())
			t.Cleanup(func() {
				_, _ = ctrl.controller.DeleteSnapshot(context.Background(), &csipb.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()})
			})
			const restored = larger + 128<<20
			r := create("grow-restored", restored, &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
				Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}})
			p = mountOn(t, g, ctrl, node, r, vc)
			expectFills(p, restored, data)
			unmountFrom(t, g, ctrl, p, r.GetVolumeId())

			t.Log("a volume cloned into a larger one")
			c := create("grow-clone", restored, &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{
				Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: vol.GetVolumeId()}}})
			p = mountOn(t, g, ctrl, node, c, vc)
			expectFills(p, restored, data)
			unmountFrom(t, g, ctrl, p, c.GetVolumeId())
		})
	}
}

// TestNodeExpandNeedsCapability: where growing a mounted ext4 needs
// CAP_SYS_RESOURCE and the node plugin lacks it, NodeExpandVolume fails
// with FailedPrecondition naming the capability (the kernel's "Permission
// denied" is no help to a user), while an expansion with nothing to grow
// succeeds and a restage leaves the volume usable. Without root, through
// the fake mounter: the root tests cover the real one.
func TestNodeExpandNeedsCapability(t *testing.T) {
	g := NewWithT(t)
	addNodes(t, "nocap-a")
	fake := newFakeMounter()
	fake.noCapSysResource = true
	ctrl := serveDriver(t, Options{Mode: ModeController})
	node := serveDriver(t, Options{Mode: ModeNode, NodeID: "nocap-a", Mounter: fake})
	ctx := callCtx(t)
	vc := volCap("ext4", false)
	created, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "nocap",
		CapacityRange: &csipb.CapacityRange{RequiredBytes: 64 << 20}, VolumeCapabilities: []*csipb.VolumeCapability{vc},
		Parameters: map[string]string{ParamNumberOfReplicas: "1", ParamFrontend: "nbd"}})
	g.Expect(err).NotTo(HaveOccurred())
	vol := created.GetVolume()
	p := mountOn(t, g, ctrl, node, vol, vc)
	expand := func(size int64) error {
		_, err := node.node.NodeExpandVolume(ctx, &csipb.NodeExpandVolumeRequest{VolumeId: vol.GetVolumeId(), VolumePath: p.target,
			StagingTargetPath: p.staging, CapacityRange: &csipb.CapacityRange{RequiredBytes: size}, VolumeCapability: vc})
		return err
	}
	g.Expect(expand(64<<20)).To(Succeed(), "nothing to grow needs no capability")

	_, err = ctrl.controller.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: vol.GetVolumeId(),
		CapacityRange: &csipb.CapacityRange{RequiredBytes: 96 << 20}, VolumeCapability: vc})
	g.Expect(err).NotTo(HaveOccurred())
	err = expand(96 << 20)
	g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "%v", err)
	g.Expect(status.Convert(err).Message()).To(ContainSubstring("CAP_SYS_RESOURCE"), "the message names what is missing")
	fs, ferr := fake.Filesystem(p.node.mustDevice(t, g, vol.GetVolumeId()))
	g.Expect(ferr).NotTo(HaveOccurred())
	g.Expect(fs.Size).To(Equal(int64(64<<20)), "nothing grew")

	_, err = node.node.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: vol.GetVolumeId(), StagingTargetPath: p.staging, VolumeCapability: vc})
	g.Expect(err).NotTo(HaveOccurred(), "staging again leaves a staged volume usable")

	t.Log("staged again, unmounted first: it grows without the capability")
	unmountFrom(t, g, ctrl, p, vol.GetVolumeId())
	p = mountOn(t, g, ctrl, node, vol, vc)
	fs, ferr = fake.Filesystem(p.node.mustDevice(t, g, vol.GetVolumeId()))
	g.Expect(ferr).NotTo(HaveOccurred())
	g.Expect(fs.Size).To(Equal(int64(96 << 20)))
	g.Expect(expand(96 << 20)).To(Succeed())
	unmountFrom(t, g, ctrl, p, vol.GetVolumeId())
	_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
}

// mustDevice is the device volume id is attached on, as the node service
// finds it.
func (d *driver) mustDevice(t *testing.T, g *WithT, id string) string {
	t.Helper()
	dev, err := d.Driver.node.device(callCtx(t), id)
	g.Expect(err).NotTo(HaveOccurred())
	return dev
}

func mustCreate(g *WithT, path string) string {
	f, err := os.Create(path)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(f.Close()).To(Succeed())
	return path
}

func mustXFS(g *WithT, dev string) xfsGeometry {
	f, err := os.Open(dev)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	x, err := readXFSGeometry(f)
	g.Expect(err).NotTo(HaveOccurred())
	return x
}

// loopDevice attaches img to a free loop device until t ends.
func loopDevice(t *testing.T, g *WithT, img string) string {
	t.Helper()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "%s", out)
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		// The kernel may hold the device a moment after an unmount.
		end := deadline.After(30 * time.Second)
		for exec.Command("losetup", "-d", dev).Run() != nil && time.Now().Before(end) {
			time.Sleep(100 * time.Millisecond)
		}
	})
	return dev
}

func runTool(g *WithT, name string, args ...string) {
	out, err := exec.Command(name, args...).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "%s %v: %s", name, args, out)
}
