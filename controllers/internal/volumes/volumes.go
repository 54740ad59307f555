// Package volumes holds what the Volume and Snapshot reconcilers both
// know of a Volume: the names and labels of its objects, and whether its
// copy from a data source is done. It imports no reconciler, so both can
// use it (and the Volume package's tests can run the Snapshot reconciler).
package volumes

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// LabelVolume marks a Volume's Engine, Replicas and Snapshots with its name.
const LabelVolume = "storage.cairn.io/volume"

// LabelCloneFor marks the Snapshot a whole-volume clone takes of its
// source with the name of the clone; it is deleted once the copy is done.
const LabelCloneFor = "storage.cairn.io/clone-for"

// SnapshotFinalizer keeps a Snapshot until its data is deleted from
// every replica its volume's engine holds.
const SnapshotFinalizer = "storage.cairn.io/snapshot"

// EngineName is the name of a volume's Engine.
func EngineName(v *v1.Volume) string { return EngineNameOf(v.Name) }

// EngineNameOf is the name of the Engine of the volume named volume.
func EngineNameOf(volume string) string { return volume + "-e" }

// AnnotationCloned records, on a Volume whose copy from its data source
// is complete and verified, the source snapshot copied
// ("<volume>/<snapshot>"). It is written before the status says so and
// never removed: it is the fact that ends copying into the volume for
// good, and it survives a restore that drops status.
const AnnotationCloned = "storage.cairn.io/cloned"

// Cloned reports whether v's copy from its data source is complete and
// verified (AnnotationCloned, or status.clone completed), or v has no data
// source. Once true, it stays true: nothing is ever copied into v again.
func Cloned(v *v1.Volume) bool {
	return v.Spec.DataSource == nil || v.Annotations[AnnotationCloned] != "" ||
		(v.Status.Clone != nil && v.Status.Clone.State == v1.CloneStateCompleted)
}

// CloneSnapshotName is the snapshot of the source a clone of v copies:
// spec.dataSource.snapshot, or for a whole-volume clone the Snapshot it
// takes of the source, "clone-<v>" (cut and hashed to stay a valid
// 63-character name).
func CloneSnapshotName(v *v1.Volume) string {
	if v.Spec.DataSource == nil {
		return ""
	}
	if v.Spec.DataSource.Snapshot != "" {
		return v.Spec.DataSource.Snapshot
	}
	name := "clone-" + v.Name
	if len(name) > 63 {
		sum := sha256.Sum256([]byte(v.Name))
		name = strings.TrimRight(name[:50], "-.") + "-" + hex.EncodeToString(sum[:])[:12]
	}
	return name
}

// ClonesFrom reports whether v still copies (or is to copy) snapshot of
// volume source; snapshot "" matches any of its snapshots.
func ClonesFrom(v *v1.Volume, source, snapshot string) bool {
	ds := v.Spec.DataSource
	return ds != nil && ds.Volume == source && !Cloned(v) && v.DeletionTimestamp.IsZero() &&
		(snapshot == "" || CloneSnapshotName(v) == snapshot)
}
