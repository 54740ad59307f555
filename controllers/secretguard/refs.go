package secretguard

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The annotations external-provisioner writes on a PersistentVolume it
// provisions: the Secret (the StorageClass's provisioner secret, its
// templates resolved) it reads again before it calls DeleteVolume. Both
// empty: the class names none.
const (
	AnnotationDeletionSecretName      = "volume.kubernetes.io/provisioner-deletion-secret-name"
	AnnotationDeletionSecretNamespace = "volume.kubernetes.io/provisioner-deletion-secret-namespace"
)

// Role is what Kubernetes reads a Secret named by a PersistentVolume for:
// one of the CSI secret parameters of a StorageClass.
type Role string

// The roles, in the order messages list them.
const (
	// RoleControllerPublish: spec.csi.controllerPublishSecretRef, read by
	// the external-attacher before every ControllerPublish and
	// ControllerUnpublish (attach and detach).
	RoleControllerPublish Role = "controller-publish"
	// RoleProvisionerDeletion: the provisioner-deletion annotations, read
	// by the external-provisioner before DeleteVolume.
	RoleProvisionerDeletion Role = "provisioner-deletion"
	// RoleNodeStage: spec.csi.nodeStageSecretRef, read by kubelet before
	// NodeStageVolume (mounting the volume on a node).
	RoleNodeStage Role = "node-stage"
	// RoleNodePublish: spec.csi.nodePublishSecretRef, read by kubelet
	// before NodePublishVolume (mounting it into a pod).
	RoleNodePublish Role = "node-publish"
	// RoleControllerExpand: spec.csi.controllerExpandSecretRef, read by
	// the external-resizer before ControllerExpandVolume.
	RoleControllerExpand Role = "controller-expand"
	// RoleNodeExpand: spec.csi.nodeExpandSecretRef, read by kubelet before
	// NodeExpandVolume (growing the filesystem).
	RoleNodeExpand Role = "node-expand"
	// RoleSnapshotterDeletion: a VolumeSnapshotContent's deletion
	// annotations (its VolumeSnapshotClass's snapshotter secret), read by
	// the csi-snapshotter before DeleteSnapshot.
	RoleSnapshotterDeletion Role = "snapshotter-deletion"
)

// reader says who reads a Secret of the role, before what, and what a
// missing one stops.
func (r Role) reader() string {
	switch r {
	case RoleControllerPublish:
		return "the external-attacher reads it before it attaches or detaches the volume, and without it the volume stays attached"
	case RoleProvisionerDeletion:
		return "the external-provisioner reads it before it deletes the volume"
	case RoleNodeStage, RoleNodePublish:
		return "kubelet reads it before it mounts the volume, and without it no pod using the volume starts"
	case RoleControllerExpand:
		return "the external-resizer reads it before it expands the volume, and without it the volume does not grow"
	case RoleNodeExpand:
		return "kubelet reads it before it grows the volume's filesystem, and without it the filesystem does not grow"
	case RoleSnapshotterDeletion:
		return "the csi-snapshotter reads it before it deletes the snapshot, and without it the VolumeSnapshotContent and the snapshot stay"
	}
	return "Kubernetes reads it"
}

// Ref is one Secret a PersistentVolume (or VolumeSnapshotContent) names,
// and for what.
type Ref struct {
	Secret types.NamespacedName
	Role   Role
}

// refsOf returns the Secrets pv names if it is a volume of driver, in
// Role order; none for a PersistentVolume of another driver or of no CSI
// driver. A reference with an empty name or namespace names nothing
// (external-provisioner writes both annotations empty when the class has
// no provisioner secret).
func refsOf(pv *corev1.PersistentVolume, driver string) []Ref {
	csi := pv.Spec.CSI
	if csi == nil || csi.Driver != driver {
		return nil
	}
	var out []Ref
	add := func(ns, name string, role Role) {
		if ns != "" && name != "" {
			out = append(out, Ref{Secret: types.NamespacedName{Namespace: ns, Name: name}, Role: role})
		}
	}
	addRef := func(ref *corev1.SecretReference, role Role) {
		if ref != nil {
			add(ref.Namespace, ref.Name, role)
		}
	}
	addRef(csi.ControllerPublishSecretRef, RoleControllerPublish)
	add(pv.Annotations[AnnotationDeletionSecretNamespace], pv.Annotations[AnnotationDeletionSecretName], RoleProvisionerDeletion)
	addRef(csi.NodeStageSecretRef, RoleNodeStage)
	addRef(csi.NodePublishSecretRef, RoleNodePublish)
	addRef(csi.ControllerExpandSecretRef, RoleControllerExpand)
	addRef(csi.NodeExpandSecretRef, RoleNodeExpand)
	return out
}

// secretsOf returns each Secret pv names once, sorted.
func secretsOf(pv *corev1.PersistentVolume, driver string) []types.NamespacedName {
	var out []types.NamespacedName
	for _, r := range refsOf(pv, driver) {
		out = append(out, r.Secret)
	}
	slices.SortFunc(out, func(a, b types.NamespacedName) int { return strings.Compare(a.String(), b.String()) })
	return slices.Compact(out)
}

// rolesOf returns the roles in which pv names secret, in Role order.
func rolesOf(pv *corev1.PersistentVolume, driver string, secret types.NamespacedName) []Role {
	var out []Role
	for _, r := range refsOf(pv, driver) {
		if r.Secret == secret && !slices.Contains(out, r.Role) {
			out = append(out, r.Role)
		}
	}
	return out
}
