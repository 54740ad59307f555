package csi

import (
	"strings"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

func TestParseParams(t *testing.T) {
	for _, tc := range []struct {
		name   string
		in     map[string]string
		want   volumeParams
		code   codes.Code
		errHas string
	}{
		{name: "empty", in: nil},
		{name: "all", in: map[string]string{"numberOfReplicas": "2", "frontend": "nbd", "fsType": "xfs", "diskSelector": "ssd, fast,"},
			want: volumeParams{replicas: 2, frontend: v1.FrontendNBD, fsType: "xfs", diskSelector: []string{"ssd", "fast"}}},
		{name: "provisioner metadata", in: map[string]string{paramPVCName: "data", paramPVCNamespace: "db", paramPVName: "pvc-1", "csi.storage.k8s.io/fstype": "ext4"},
			want: volumeParams{pvc: "db/data", pv: "pvc-1"}},
		{name: "unknown", in: map[string]string{"replicas": "3"}, code: codes.InvalidArgument, errHas: `unknown StorageClass parameter "replicas"`},
		{name: "zero replicas", in: map[string]string{"numberOfReplicas": "0"}, code: codes.InvalidArgument, errHas: "from 1 to 10"},
		{name: "eleven replicas", in: map[string]string{"numberOfReplicas": "11"}, code: codes.InvalidArgument, errHas: "from 1 to 10"},
		{name: "replicas not a number", in: map[string]string{"numberOfReplicas": "three"}, code: codes.InvalidArgument,
			errHas: `StorageClass parameter numberOfReplicas="three": must be a whole number from 1 to 10`},
		{name: "bad frontend", in: map[string]string{"frontend": "iscsi"}, code: codes.InvalidArgument, errHas: "fuse"},
		{name: "bad fs", in: map[string]string{"fsType": "btrfs"}, code: codes.InvalidArgument, errHas: "btrfs"},
		{name: "long tag", in: map[string]string{"diskSelector": strings.Repeat("x", 64)}, code: codes.InvalidArgument},
		{name: "too many tags", in: map[string]string{"diskSelector": strings.Repeat("a,", 17)}, code: codes.InvalidArgument},
		{name: "recurring job groups", in: map[string]string{"recurringJobGroups": " daily, weekly-1,,daily"},
			want: volumeParams{recurringJobGroups: []string{"daily", "weekly-1"}}},
		{name: "group not a DNS label", in: map[string]string{"recurringJobGroups": "daily,Week_ly"}, code: codes.InvalidArgument, errHas: `group "Week_ly" must be a DNS label`},
		{name: "group too long", in: map[string]string{"recurringJobGroups": strings.Repeat("g", v1.MaxRecurringJobGroupLength+1)}, code: codes.InvalidArgument},
		{name: "longest group", in: map[string]string{"recurringJobGroups": strings.Repeat("g", v1.MaxRecurringJobGroupLength)},
			want: volumeParams{recurringJobGroups: []string{strings.Repeat("g", v1.MaxRecurringJobGroupLength)}}},
		{name: "default backup target", in: map[string]string{"backupTarget": "offsite"}, want: volumeParams{backupTarget: "offsite"}},
		{name: "backup target not a name", in: map[string]string{"backupTarget": "Off Site"}, code: codes.InvalidArgument, errHas: "must name a BackupTarget"},
		{name: "too many groups", in: map[string]string{"recurringJobGroups": "a0,a1,a2,a3,a4,a5,a6,a7,a8,a9,b0,b1,b2,b3,b4,b5,b6"}, code: codes.InvalidArgument, errHas: "at most 16 groups"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := parseParams(tc.in)
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			if tc.code != codes.OK {
				g.Expect(err.Error()).To(ContainSubstring(tc.errHas))
				return
			}
			g.Expect(got).To(Equal(tc.want))
		})
	}
}

func TestVolumeSize(t *testing.T) {
	for _, tc := range []struct {
		name     string
		req, lim int64
		min      int64
		want     int64
		code     codes.Code
	}{
		{name: "unset is the smallest volume", want: 1 << 20},
		{name: "rounded up to 4 KiB", req: 10<<20 + 1, want: 10<<20 + 4096},
		{name: "exact", req: 8 << 20, lim: 8 << 20, want: 8 << 20},
		{name: "below 1 MiB grows to it", req: 4096, want: 1 << 20},
		{name: "source size is the floor", min: 32 << 20, want: 32 << 20},
		{name: "limit below rounded size", req: 10<<20 + 1, lim: 10<<20 + 10, code: codes.OutOfRange},
		{name: "limit below 1 MiB", lim: 4096, code: codes.OutOfRange},
		{name: "required above limit", req: 2 << 20, lim: 1 << 20, code: codes.InvalidArgument},
		{name: "negative", req: -1, code: codes.InvalidArgument},
		{name: "the largest", req: v1.MaxVolumeSize, want: v1.MaxVolumeSize},
		{name: "rounded up to the largest", req: v1.MaxVolumeSize - 1, want: v1.MaxVolumeSize},
		{name: "a byte over the largest", req: v1.MaxVolumeSize + 1, code: codes.OutOfRange},
		{name: "100Ti", req: 100 << 40, lim: 100 << 40, code: codes.OutOfRange},
		{name: "limit above the largest", req: 1 << 30, lim: 1 << 50, want: 1 << 30},
		{name: "absurd", req: 1<<62 + 1, code: codes.OutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := volumeSize(&csipb.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim}, tc.min)
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			if tc.code == codes.OK {
				g.Expect(got).To(Equal(tc.want))
			}
		})
	}
}

// TestLargestVolume: GetCapacity's maximum volume size is one CreateVolume
// makes with exactly that size as required and limit bytes.
func TestLargestVolume(t *testing.T) {
	for _, tc := range []struct {
		name       string
		room, want int64
	}{
		{name: "no room", room: 0, want: 0},
		{name: "less than the smallest volume", room: 1<<20 - 4096, want: 0},
		{name: "the smallest volume", room: 1 << 20, want: 1 << 20},
		{name: "rounded down to 4 KiB", room: 10<<20 + 4095, want: 10 << 20},
		{name: "64 TiB", room: v1.MaxVolumeSize, want: v1.MaxVolumeSize},
		{name: "100 TiB of room is a 64 TiB volume", room: 100 << 40, want: v1.MaxVolumeSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got := largestVolume(tc.room)
			g.Expect(got).To(Equal(tc.want))
			if got > 0 {
				size, err := volumeSize(&csipb.CapacityRange{RequiredBytes: got, LimitBytes: got}, 0)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(size).To(Equal(got))
			}
		})
	}
}

func capOf(mode csipb.VolumeCapability_AccessMode_Mode, block bool, fs string) *csipb.VolumeCapability {
	c := &csipb.VolumeCapability{AccessMode: &csipb.VolumeCapability_AccessMode{Mode: mode}}
	if block {
		c.AccessType = &csipb.VolumeCapability_Block{Block: &csipb.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{FsType: fs}}
	}
	return c
}

func TestCheckCapability(t *testing.T) {
	m := csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	for _, tc := range []struct {
		name   string
		c      *csipb.VolumeCapability
		errHas string
	}{
		{name: "mount ext4", c: capOf(m, false, "ext4")},
		{name: "mount xfs", c: capOf(m, false, "xfs")},
		{name: "mount default fs", c: capOf(m, false, "")},
		{name: "block", c: capOf(m, true, "")},
		{name: "single writer", c: capOf(csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, true, "")},
		{name: "multi node", c: capOf(csipb.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, false, ""),
			errHas: "access mode ReadWriteMany (MULTI_NODE_MULTI_WRITER) is not supported: a Cairn volume is attached to one node at a time (ReadWriteOnce or ReadWriteOncePod); multi-node access needs a share manager"},
		{name: "multi node block", c: capOf(csipb.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, true, ""), errHas: "access mode ReadWriteMany (MULTI_NODE_MULTI_WRITER) is not supported"},
		{name: "multi node reader", c: capOf(csipb.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, false, ""), errHas: "access mode ReadOnlyMany (MULTI_NODE_READER_ONLY) is not supported: a Cairn volume is attached to one node at a time"},
		{name: "multi node single writer", c: capOf(csipb.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER, false, ""), errHas: "access mode MULTI_NODE_SINGLE_WRITER is not supported"},
		{name: "no mode", c: capOf(csipb.VolumeCapability_AccessMode_UNKNOWN, false, ""), errHas: "no access mode"},
		{name: "btrfs", c: capOf(m, false, "btrfs"), errHas: "btrfs"},
		{name: "no access type", c: &csipb.VolumeCapability{AccessMode: &csipb.VolumeCapability_AccessMode{Mode: m}}, errHas: "neither block nor mount"},
		{name: "nil", c: nil, errHas: "empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := checkCapability(tc.c)
			if tc.errHas == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(MatchError(ContainSubstring(tc.errHas)))
		})
	}
}

func TestObjectName(t *testing.T) {
	g := NewWithT(t)
	g.Expect(objectName("vol-", "pvc-0b5e6a1c-1d2f-4a55-9d8e-2f7c1e3b4a5d")).To(Equal("pvc-0b5e6a1c-1d2f-4a55-9d8e-2f7c1e3b4a5d"))
	hashed := objectName("vol-", "Sanity Volume/1")
	g.Expect(hashed).To(HavePrefix("vol-"))
	g.Expect(dnsLabel.MatchString(hashed)).To(BeTrue())
	g.Expect(objectName("vol-", "Sanity Volume/1")).To(Equal(hashed), "the same name gives the same object")
	g.Expect(objectName("vol-", "Sanity Volume/2")).NotTo(Equal(hashed))
	g.Expect(objectName("vol-", strings.Repeat("a", 64))).To(HaveLen(44), "too long for a label: hashed")
}

func TestPage(t *testing.T) {
	g := NewWithT(t)
	names := []string{"c", "a", "d", "b"}
	p, next, err := page(names, "", 2)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(p).To(Equal([]string{"a", "b"}))
	g.Expect(next).To(Equal("after:b"))
	// b deleted between pages: the next page still starts after it.
	p, next, err = page([]string{"a", "c", "d"}, next, 2)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(p).To(Equal([]string{"c", "d"}))
	g.Expect(next).To(BeEmpty())
	p, _, err = page([]string{"a"}, "", 0)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(p).To(Equal([]string{"a"}))
	_, _, err = page(names, "invalid-token", 0)
	g.Expect(status.Code(err)).To(Equal(codes.Aborted))
	_, _, err = page(names, "", -1)
	g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument))
}

func TestStripSecrets(t *testing.T) {
	g := NewWithT(t)
	req := &csipb.NodeStageVolumeRequest{VolumeId: "v1", Secrets: map[string]string{"password": "hunter2"},
		VolumeContext: map[string]string{"fsType": "ext4"}}
	out := stripSecrets(req)
	g.Expect(out).NotTo(ContainSubstring("hunter2"))
	g.Expect(out).To(ContainSubstring("stripped"))
	g.Expect(out).To(ContainSubstring("v1"))
	g.Expect(req.Secrets["password"]).To(Equal("hunter2"), "the request itself is left alone")
}

func TestParseEndpoint(t *testing.T) {
	g := NewWithT(t)
	for in, want := range map[string][2]string{
		"unix:///csi/csi.sock":  {"unix", "/csi/csi.sock"},
		"unix:/csi/csi.sock":    {"unix", "/csi/csi.sock"},
		"/csi/csi.sock":         {"unix", "/csi/csi.sock"},
		"tcp://127.0.0.1:10000": {"tcp", "127.0.0.1:10000"},
	} {
		n, a, err := parseEndpoint(in)
		g.Expect(err).NotTo(HaveOccurred(), in)
		g.Expect([2]string{n, a}).To(Equal(want), in)
	}
	for _, bad := range []string{"http://x", "unix://", "tcp://"} {
		_, _, err := parseEndpoint(bad)
		g.Expect(err).To(HaveOccurred(), bad)
	}
}

// TestDesiredVolumeGroups: the StorageClass's recurringJobGroups become
// the Volume's group labels, which RecurringJob spec.groups select.
func TestDesiredVolumeGroups(t *testing.T) {
	g := NewWithT(t)
	p, err := parseParams(map[string]string{ParamRecurringJobGroups: "daily,weekly"})
	g.Expect(err).NotTo(HaveOccurred())
	v := desiredVolume(&csipb.CreateVolumeRequest{Name: "pvc-1"}, "pvc-1", "cairn-system", 8<<20, p, nil, nil)
	g.Expect(v.Labels).To(Equal(map[string]string{
		"storage.cairn.io/recurring-job-group.daily":  "enabled",
		"storage.cairn.io/recurring-job-group.weekly": "enabled",
	}))
	p, err = parseParams(nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(desiredVolume(&csipb.CreateVolumeRequest{Name: "pvc-2"}, "pvc-2", "cairn-system", 8<<20, p, nil, nil).Labels).To(BeEmpty())
	p, err = parseParams(map[string]string{ParamDefaultBackupTarget: "offsite"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(desiredVolume(&csipb.CreateVolumeRequest{Name: "pvc-3"}, "pvc-3", "cairn-system", 8<<20, p, nil, nil).Spec.BackupTarget).To(Equal("offsite"),
		"the StorageClass's backupTarget is the volume's default target")
}
