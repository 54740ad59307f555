package volume

import (
	"context"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// EngineName is the name of a volume's Engine.
func EngineName(v *v1.Volume) string { return volumes.EngineName(v) }

// ensureEngine creates the Engine (stopped) if it is missing.
func (r *Reconciler) ensureEngine(ctx context.Context, s *scope) error {
	if s.engine != nil {
		return nil
	}
	e := &v1.Engine{ObjectMeta: metav1.ObjectMeta{Name: EngineName(s.v), Namespace: s.v.Namespace, Labels: map[string]string{LabelVolume: s.v.Name}},
		Spec: v1.EngineSpec{VolumeName: s.v.Name, Size: s.v.Spec.Size, Frontend: s.v.Spec.Frontend, DesiredState: v1.DesiredInstanceStateStopped,
			Encryption: s.v.Spec.Encryption}}
	if err := controllerutil.SetControllerReference(s.v, e, r.Scheme()); err != nil {
		return err
	}
	// A crash after the create: the next reconcile gets it by name.
	if err := r.Create(ctx, e); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	s.engine = e
	return nil
}

func (r *Reconciler) setEngine(ctx context.Context, e *v1.Engine, mutate func(*v1.Engine)) error {
	before := e.DeepCopy()
	mutate(e)
	if equalEngineSpec(before, e) {
		return nil
	}
	return r.Patch(ctx, e, client.MergeFrom(before))
}

// equalEngineSpec reports whether a patch from a's spec to b's would
// change nothing: field by field, the pointed-to values of encryption and
// cloneFrom and quantities by value, so an unchanged encrypted or cloning
// engine is not patched on every reconcile.
func equalEngineSpec(a, b *v1.Engine) bool {
	return equality.Semantic.DeepEqual(a.Spec, b.Spec)
}
