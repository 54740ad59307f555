package secretguard

import (
	"context"
	"fmt"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// The annotations the external-snapshotter writes on a
// VolumeSnapshotContent whose VolumeSnapshotClass has a snapshotter
// secret (csi.storage.k8s.io/snapshotter-secret-name and -namespace, its
// templates resolved). The csi-snapshotter sidecar reads that Secret
// before DeleteSnapshot and, while it is missing, retries for good: the
// VolumeSnapshotContent keeps its finalizer and the snapshot stays.
const (
	AnnotationSnapshotDeletionSecretName      = "snapshot.storage.kubernetes.io/deletion-secret-name"
	AnnotationSnapshotDeletionSecretNamespace = "snapshot.storage.kubernetes.io/deletion-secret-namespace"
)

// The snapshot kinds, read as unstructured objects: the guard needs two
// annotations and two spec fields of them, and the external-snapshotter's
// CRDs may not be installed at all.
var (
	contentGVK  = schema.GroupVersionKind{Group: "snapshot.storage.k8s.io", Version: "v1", Kind: "VolumeSnapshotContent"}
	snapshotGVK = schema.GroupVersionKind{Group: "snapshot.storage.k8s.io", Version: "v1", Kind: "VolumeSnapshot"}
)

// contentObject returns an empty unstructured VolumeSnapshotContent.
func contentObject() *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(contentGVK)
	return u
}

// snapshotsServed tells whether the API server serves
// VolumeSnapshotContents (the external-snapshotter's CRDs are
// installed). Their absence is not an error: the guard then watches
// PersistentVolumes only, and says so in log.
func snapshotsServed(mapper meta.RESTMapper, log logr.Logger) (bool, error) {
	_, err := mapper.RESTMapping(contentGVK.GroupKind(), contentGVK.Version)
	switch {
	case err == nil:
		return true, nil
	case meta.IsNoMatchError(err):
		log.Info("the API server does not serve VolumeSnapshotContents (the external-snapshotter's CRDs are not installed): "+
			"the Secrets of snapshots are not guarded; restart cairn-manager after installing the CRDs to guard them",
			"groupVersionKind", contentGVK.String())
		return false, nil
	}
	return false, fmt.Errorf("look up %s: %w", contentGVK, err)
}

// contentSecret returns the Secret a VolumeSnapshotContent of driver
// names in its deletion annotations, and false for one of another
// driver or naming none (both annotations must be set and non-empty).
func contentSecret(u *unstructured.Unstructured, driver string) (types.NamespacedName, bool) {
	if d, _, _ := unstructured.NestedString(u.Object, "spec", "driver"); d != driver {
		return types.NamespacedName{}, false
	}
	ann := u.GetAnnotations()
	s := types.NamespacedName{Namespace: ann[AnnotationSnapshotDeletionSecretNamespace], Name: ann[AnnotationSnapshotDeletionSecretName]}
	return s, s.Namespace != "" && s.Name != ""
}

// slimContent is the cache's transform of a VolumeSnapshotContent: one of
// driver keeps its identity, its deletion annotations, its driver and its
// VolumeSnapshot's reference; one of another driver its identity only.
func slimContent(in *unstructured.Unstructured, driver string) *unstructured.Unstructured {
	out := contentObject()
	out.SetName(in.GetName())
	out.SetUID(in.GetUID())
	out.SetResourceVersion(in.GetResourceVersion())
	d, _, _ := unstructured.NestedString(in.Object, "spec", "driver")
	if d != driver {
		return out
	}
	_ = unstructured.SetNestedField(out.Object, d, "spec", "driver")
	ann := map[string]string{}
	for _, k := range []string{AnnotationSnapshotDeletionSecretName, AnnotationSnapshotDeletionSecretNamespace} {
		if v, ok := in.GetAnnotations()[k]; ok {
			ann[k] = v
		}
	}
	if len(ann) > 0 {
		out.SetAnnotations(ann)
	}
	if ref, ok, _ := unstructured.NestedStringMap(in.Object, "spec", "volumeSnapshotRef"); ok {
		keep := map[string]any{}
		for _, k := range []string{"namespace", "name", "uid"} {
			if v := ref[k]; v != "" {
				keep[k] = v
			}
		}
		_ = unstructured.SetNestedField(out.Object, keep, "spec", "volumeSnapshotRef")
	}
	return out
}

// contentsOf lists the VolumeSnapshotContents of the driver that name
// secret, as the cache has them; none when snapshots are not served.
func (r *Reconciler) contentsOf(ctx context.Context, secret types.NamespacedName) ([]unstructured.Unstructured, error) {
	if !r.snapshots {
		return nil, nil
	}
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(contentGVK.GroupVersion().WithKind(contentGVK.Kind + "List"))
	if err := r.cache.List(ctx, list, client.MatchingFields{indexSecrets: secret.String()}); err != nil {
		return nil, fmt.Errorf("list the VolumeSnapshotContents naming Secret %s: %w", secret, err)
	}
	return list.Items, nil
}

// reportMissingOnContents records, on each VolumeSnapshotContent in
// contents and on its VolumeSnapshot if it still exists, that secret
// does not exist.
func (r *Reconciler) reportMissingOnContents(ctx context.Context, secret types.NamespacedName, contents []unstructured.Unstructured) {
	for i := range contents {
		content := &contents[i]
		note := missingNote(secret, kindContent, content.GetName(), []Role{RoleSnapshotterDeletion})
		objects.Event(r.Recorder, content, true, v1.EventReasonSecretMissing, "CheckSecret", "%s", note)
		if snap := r.snapshotOf(ctx, content); snap != nil {
			objects.Event(r.Recorder, snap, true, v1.EventReasonSecretMissing, "CheckSecret", "%s", note)
		}
	}
}

// snapshotOf returns content's VolumeSnapshot if it still exists (the
// object the content was bound to, by UID), else nil. One that cannot be
// read is logged and skipped.
func (r *Reconciler) snapshotOf(ctx context.Context, content *unstructured.Unstructured) *unstructured.Unstructured {
	ref, _, _ := unstructured.NestedStringMap(content.Object, "spec", "volumeSnapshotRef")
	if ref["namespace"] == "" || ref["name"] == "" {
		return nil
	}
	snap := &unstructured.Unstructured{}
	snap.SetGroupVersionKind(snapshotGVK)
	if err := r.Reader.Get(ctx, client.ObjectKey{Namespace: ref["namespace"], Name: ref["name"]}, snap); err != nil {
		if !apierrors.IsNotFound(err) {
			ctrl.LoggerFrom(ctx).Error(err, "read the VolumeSnapshot of a VolumeSnapshotContent", "volumeSnapshotContent", content.GetName())
		}
		return nil
	}
	if uid := ref["uid"]; uid != "" && string(snap.GetUID()) != uid {
		return nil
	}
	return snap
}

func contentNames(contents []unstructured.Unstructured) []string {
	out := make([]string, 0, len(contents))
	for i := range contents {
		out = append(out, contents[i].GetName())
	}
	return out
}
