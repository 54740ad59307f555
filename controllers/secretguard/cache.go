package secretguard

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// indexSecrets indexes PersistentVolumes and VolumeSnapshotContents by
// the Secrets they name (types.NamespacedName.String()).
const indexSecrets = "secretguard.secrets"

// secretMeta returns an empty metadata-only Secret: what the guard reads,
// watches and patches Secrets as. The API server sends it a Secret's
// metadata only, never its data.
func secretMeta() *metav1.PartialObjectMetadata {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Secret"))
	return m
}

// newCache makes the guard's own cache, beside the manager's: it holds
// the metadata of every Secret, cut down by slim to what the guard
// decides from, and PersistentVolumes and, if snapshots,
// VolumeSnapshotContents (those of other drivers cut down to their
// names), indexed by the Secrets they name. Its own cache keeps
// Secrets out of the manager's shared one (where a full Secret informer,
// data included, would start the day some code reads a Secret through the
// manager's client), and reading anything else from it is an error.
func newCache(mgr ctrl.Manager, driver string, snapshots bool) (cache.Cache, error) {
	c, err := cache.New(mgr.GetConfig(), cache.Options{
		HTTPClient:                  mgr.GetHTTPClient(),
		Scheme:                      mgr.GetScheme(),
		Mapper:                      mgr.GetRESTMapper(),
		DefaultTransform:            slim(driver),
		ReaderFailOnMissingInformer: true,
	})
	if err != nil {
		return nil, fmt.Errorf("secret guard's cache: %w", err)
	}
	// The informers exist before the cache starts, so that reads and the
	// index work from its first sync.
	ctx := context.Background()
	if _, err := c.GetInformer(ctx, secretMeta(), cache.BlockUntilSynced(false)); err != nil {
		return nil, fmt.Errorf("secret guard's Secret informer: %w", err)
	}
	if err := c.IndexField(ctx, &corev1.PersistentVolume{}, indexSecrets, func(o client.Object) []string {
		var out []string
		for _, s := range secretsOf(o.(*corev1.PersistentVolume), driver) {
			out = append(out, s.String())
		}
		return out
	}); err != nil {
		return nil, fmt.Errorf("secret guard's PersistentVolume index: %w", err)
	}
	if snapshots {
		if err := c.IndexField(ctx, contentObject(), indexSecrets, func(o client.Object) []string {
			if s, ok := contentSecret(o.(*unstructured.Unstructured), driver); ok {
				return []string{s.String()}
			}
			return nil
		}); err != nil {
			return nil, fmt.Errorf("secret guard's VolumeSnapshotContent index: %w", err)
		}
	}
	if err := mgr.Add(c); err != nil {
		return nil, fmt.Errorf("add the secret guard's cache: %w", err)
	}
	return c, nil
}

// slim is the cache's transform. A Secret keeps its identity, its
// deletion timestamp and its finalizers only: not its labels or
// annotations (kubectl apply's last-applied-configuration annotation
// holds a copy of the Secret's data). A PersistentVolume of driver loses
// its managed fields; one of another driver keeps its name and version
// only (the guard never looks at it). A VolumeSnapshotContent is cut down
// by slimContent. Anything else passes unchanged.
func slim(driver string) toolscache.TransformFunc {
	return func(in any) (any, error) {
		switch o := in.(type) {
		case *metav1.PartialObjectMetadata:
			return &metav1.PartialObjectMetadata{TypeMeta: o.TypeMeta, ObjectMeta: metav1.ObjectMeta{
				Name: o.Name, Namespace: o.Namespace, UID: o.UID, ResourceVersion: o.ResourceVersion,
				DeletionTimestamp: o.DeletionTimestamp, Finalizers: o.Finalizers,
			}}, nil
		case *corev1.PersistentVolume:
			if o.Spec.CSI == nil || o.Spec.CSI.Driver != driver {
				return &corev1.PersistentVolume{TypeMeta: o.TypeMeta, ObjectMeta: metav1.ObjectMeta{
					Name: o.Name, UID: o.UID, ResourceVersion: o.ResourceVersion}}, nil
			}
			o.ManagedFields = nil
			return o, nil
		case *unstructured.Unstructured:
			if o.GroupVersionKind() == contentGVK {
				return slimContent(o, driver), nil
			}
		}
		return in, nil
	}
}

// users are the objects of the driver that name one Secret.
type users struct {
	pvs      []corev1.PersistentVolume
	contents []unstructured.Unstructured
}

func (u users) empty() bool { return len(u.pvs) == 0 && len(u.contents) == 0 }

// keysAndValues names the users for a log line.
func (u users) keysAndValues() []any {
	return []any{"persistentVolumes", names(u.pvs), "volumeSnapshotContents", contentNames(u.contents)}
}

// usersOf lists the PersistentVolumes and VolumeSnapshotContents of the
// driver that name secret, as the cache has them (deleted ones go from it
// when they go from the API).
func (r *Reconciler) usersOf(ctx context.Context, secret types.NamespacedName) (users, error) {
	var pvs corev1.PersistentVolumeList
	if err := r.cache.List(ctx, &pvs, client.MatchingFields{indexSecrets: secret.String()}); err != nil {
		return users{}, fmt.Errorf("list the PersistentVolumes naming Secret %s: %w", secret, err)
	}
	contents, err := r.contentsOf(ctx, secret)
	if err != nil {
		return users{}, err
	}
	return users{pvs: pvs.Items, contents: contents}, nil
}
