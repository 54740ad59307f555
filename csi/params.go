package csi

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// StorageClass parameters.
const (
	ParamNumberOfReplicas = "numberOfReplicas"
	ParamFrontend         = "frontend"
	ParamFSType           = "fsType"
	ParamDiskSelector     = "diskSelector"
	// ParamRecurringJobGroups is a comma-separated list of RecurringJob
	// groups; the Volume is labelled into each (v1.RecurringJobGroupLabel).
	ParamRecurringJobGroups = "recurringJobGroups"
	// ParamDefaultBackupTarget names the BackupTarget the volume's backups
	// go to when a backup VolumeSnapshotClass names none (the Volume's
	// spec.backupTarget). The same key as the VolumeSnapshotClass's.
	ParamDefaultBackupTarget = "backupTarget"
)

// knownParams are the StorageClass parameters CreateVolume takes, for
// the error that names an unknown one.
var knownParams = []string{ParamNumberOfReplicas, ParamFrontend, ParamFSType, ParamDiskSelector, ParamEncrypted, ParamRecurringJobGroups, ParamDefaultBackupTarget}

// Keys the external-provisioner adds (with --extra-create-metadata) or
// reserves; they are accepted and recorded, never rejected.
const (
	provisionerPrefix = "csi.storage.k8s.io/"
	paramPVCName      = provisionerPrefix + "pvc/name"
	paramPVCNamespace = provisionerPrefix + "pvc/namespace"
	paramPVName       = provisionerPrefix + "pv/name"
)

// Annotations the driver puts on the objects it creates.
const (
	// AnnotationCSIName is the name the CO gave the volume or snapshot
	// (the object name is derived from it when it is not a DNS label).
	AnnotationCSIName = "storage.cairn.io/csi-name"
	// AnnotationPVC is the namespace/name of the claim a volume was made for.
	AnnotationPVC = "storage.cairn.io/pvc"
	// AnnotationPV is the PersistentVolume a volume backs.
	AnnotationPV = "storage.cairn.io/pv"
)

// Volume context keys (CreateVolume's answer, given back to NodeStage).
const (
	ctxFSType   = "fsType"
	ctxFrontend = "frontend"
)

// Filesystems NodeStage formats with.
const (
	fsExt4        = "ext4"
	fsXFS         = "xfs"
	defaultFSType = fsExt4
)

// blockSize is what sizes are rounded up to; minVolumeSize and
// maxVolumeSize bound a volume (the Volume kind's own limits).
const (
	blockSize     = v1.BlockSize
	minVolumeSize = v1.MinVolumeSize
	maxVolumeSize = v1.MaxVolumeSize
)

// volumeParams is what a StorageClass asks of a volume.
type volumeParams struct {
	// replicas is 0 when not given: the Volume is created without
	// numberOfReplicas, and the CRD's default (v1.DefaultNumberOfReplicas)
	// applies.
	replicas     int32
	frontend     v1.Frontend
	fsType       string
	diskSelector []string
	encrypted    bool
	pvc, pv      string
	// recurringJobGroups are the RecurringJob groups the Volume is put in.
	recurringJobGroups []string
	// backupTarget is the Volume's default BackupTarget.
	backupTarget string
}

// parseParams checks StorageClass parameters. An unknown key is an error
// naming it, so a typo does not silently give a volume other than the one
// asked for.
func parseParams(p map[string]string) (volumeParams, error) {
	var out volumeParams
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		val := p[k]
		switch k {
		case ParamNumberOfReplicas:
			n, err := strconv.Atoi(strings.TrimSpace(val))
			if err != nil || n < 1 || n > v1.MaxReplicas {
				return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s=%q: must be a whole number from 1 to %d", k, val, v1.MaxReplicas)
			}
			out.replicas = int32(n)
		case ParamFrontend:
			switch f := v1.Frontend(val); f {
			case v1.FrontendFUSE, v1.FrontendNBD:
				out.frontend = f
			default:
				return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s=%q: must be %q (any node with FUSE and loop devices) or %q (needs the nbd kernel module)", k, val, v1.FrontendFUSE, v1.FrontendNBD)
			}
		case ParamFSType:
			if err := checkFSType(val); err != nil {
				return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s: %s", k, err)
			}
			out.fsType = val
		case ParamDiskSelector:
			for _, tag := range strings.Split(val, ",") {
				tag = strings.TrimSpace(tag)
				if tag == "" {
					continue
				}
				if len(tag) > 63 {
					return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s: tag %q is longer than 63 characters", k, tag)
				}
				out.diskSelector = append(out.diskSelector, tag)
			}
			if len(out.diskSelector) > 16 {
				return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s: at most 16 tags, got %d", k, len(out.diskSelector))
			}
		case ParamRecurringJobGroups:
			g, err := parseGroups(val)
			if err != nil {
				return out, err
			}
			out.recurringJobGroups = g
		case ParamDefaultBackupTarget:
			if len(validation.IsDNS1123Subdomain(val)) > 0 {
				return out, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s=%q: must name a BackupTarget (a DNS subdomain name, kubectl get backuptargets)", k, val)
			}
			out.backupTarget = val
		case ParamEncrypted:
			b, err := parseEncrypted(val)
			if err != nil {
				return out, err
			}
			out.encrypted = b
		case paramPVCName:
			out.pvc = p[paramPVCNamespace] + "/" + val
		case paramPVName:
			out.pv = val
		default:
			if strings.HasPrefix(k, provisionerPrefix) {
				continue
			}
			return out, status.Errorf(codes.InvalidArgument, "unknown StorageClass parameter %q: remove it from the StorageClass; known parameters are %s", k, strings.Join(knownParams, ", "))
		}
	}
	return out, nil
}

// groupName is a RecurringJob group name: a DNS label short enough for
// the label key it makes.
var groupName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)

// parseGroups reads recurringJobGroups: comma-separated group names,
// blanks and repeats dropped, at most v1.MaxRecurringJobGroups.
func parseGroups(val string) ([]string, error) {
	var out []string
	for _, g := range strings.Split(val, ",") {
		g = strings.TrimSpace(g)
		if g == "" || slices.Contains(out, g) {
			continue
		}
		if len(g) > v1.MaxRecurringJobGroupLength || !groupName.MatchString(g) {
			return nil, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s: group %q must be a DNS label (lower-case letters, digits and '-') of at most %d characters", ParamRecurringJobGroups, g, v1.MaxRecurringJobGroupLength)
		}
		out = append(out, g)
	}
	if len(out) > v1.MaxRecurringJobGroups {
		return nil, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s: at most %d groups, got %d", ParamRecurringJobGroups, v1.MaxRecurringJobGroups, len(out))
	}
	return out, nil
}

func checkFSType(fs string) error {
	switch fs {
	case "", fsExt4, fsXFS:
		return nil
	}
	return fmt.Errorf("filesystem %q is not supported: use %s or %s", fs, fsExt4, fsXFS)
}

// volumeSize turns a capacity range into a size: the required bytes (or
// the smallest volume when unset) rounded up to 4 KiB, which must not pass
// the limit.
func volumeSize(r *csipb.CapacityRange, min int64) (int64, error) {
	req, lim := int64(0), int64(0)
	if r != nil {
		req, lim = r.GetRequiredBytes(), r.GetLimitBytes()
	}
	if req < 0 || lim < 0 {
		return 0, status.Errorf(codes.InvalidArgument, "capacity range: required_bytes (%d) and limit_bytes (%d) must not be negative", req, lim)
	}
	if lim > 0 && req > lim {
		return 0, status.Errorf(codes.InvalidArgument, "capacity range: required_bytes %d is more than limit_bytes %d", req, lim)
	}
	size := max(req, min, minVolumeSize)
	if size > maxVolumeSize {
		return 0, status.Errorf(codes.OutOfRange, "capacity range: required_bytes %d (%s) is more than 64 TiB (%d bytes), the largest volume Cairn serves; ask for at most that",
			size, resource.NewQuantity(size, resource.BinarySI), int64(maxVolumeSize))
	}
	size = (size + blockSize - 1) / blockSize * blockSize
	if lim > 0 && size > lim {
		return 0, status.Errorf(codes.OutOfRange, "capacity range: a volume is a multiple of 4096 bytes and at least %d bytes, so %d bytes is the smallest that fits, which is more than limit_bytes %d; raise the limit", max(min, minVolumeSize), size, lim)
	}
	return size, nil
}

// checkCapabilities accepts single-node access, mount (ext4, xfs) or block.
func checkCapabilities(caps []*csipb.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	for _, c := range caps {
		if err := checkCapability(c); err != nil {
			return status.Error(codes.InvalidArgument, err.Error())
		}
	}
	return nil
}

func checkCapability(c *csipb.VolumeCapability) error {
	if c == nil {
		return fmt.Errorf("a volume capability is empty")
	}
	switch m := c.GetAccessMode().GetMode(); m {
	case csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY:
	case csipb.VolumeCapability_AccessMode_UNKNOWN:
		return fmt.Errorf("a volume capability has no access mode")
	default:
		return fmt.Errorf("access mode %s is not supported: a Cairn volume is attached to one node at a time (ReadWriteOnce or ReadWriteOncePod); multi-node access needs a share manager, which Cairn does not have yet", accessModeName(m))
	}
	switch {
	case c.GetBlock() != nil:
	case c.GetMount() != nil:
		if err := checkFSType(c.GetMount().GetFsType()); err != nil {
			return err
		}
	default:
		return fmt.Errorf("a volume capability has neither block nor mount access type")
	}
	return nil
}

// accessModeName names a multi-node CSI access mode as a claim writes it
// (the external-provisioner maps ReadWriteMany to MULTI_NODE_MULTI_WRITER
// and ReadOnlyMany to MULTI_NODE_READER_ONLY), with the CSI name beside it.
func accessModeName(m csipb.VolumeCapability_AccessMode_Mode) string {
	switch m {
	case csipb.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return "ReadWriteMany (" + m.String() + ")"
	case csipb.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		return "ReadOnlyMany (" + m.String() + ")"
	}
	return m.String()
}

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// objectName derives an object name from a CO's name: the name itself when
// it is a DNS label (external-provisioner's pvc-<uid>, -snapshotter's
// snapshot-<uid>), else prefix and a hash of it. The same CO name always
// gives the same object name, which makes CreateVolume and CreateSnapshot
// idempotent by name.
func objectName(prefix, name string) string {
	if dnsLabel.MatchString(name) {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return prefix + hex.EncodeToString(sum[:20])
}
