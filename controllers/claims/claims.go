// Package claims connects Cairn's volumes to the PersistentVolumeClaims
// users know. A claim is bound to a PersistentVolume; a PersistentVolume
// of Cairn's CSI driver carries the Volume's name as its CSI volume handle
// (and, as provisioned, as its own name). The package resolves a claim to
// its Volume and back (for `kubectl cairn doctor` and the web page), and
// runs the forwarder that records a volume's trouble as Events on its
// claim and the pods using it (Forwarder).
package claims

import (
	"context"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/cairn-io/cairn/controllers/workload"
)

// DriverName is Cairn's CSI driver: its PersistentVolumes name it in
// spec.csi.driver.
const DriverName = workload.DriverName

// Why a claim does not resolve to a Cairn volume; test with errors.Is.
var (
	// ErrNoClaim: no claim of that name in that namespace.
	ErrNoClaim = errors.New("no such PersistentVolumeClaim")
	// ErrNotBound: the claim is not bound to a PersistentVolume (yet).
	ErrNotBound = errors.New("claim not bound")
	// ErrNoPersistentVolume: the claim names a PersistentVolume that does
	// not exist.
	ErrNoPersistentVolume = errors.New("claim's PersistentVolume missing")
	// ErrOtherDriver: the claim's PersistentVolume is not one of Cairn's.
	ErrOtherDriver = errors.New("claim of another driver")
)

// resolveError is a sentinel with the message a person reads: the cause
// and what to do.
type resolveError struct {
	kind error
	msg  string
}

func (e *resolveError) Error() string { return e.msg }
func (e *resolveError) Unwrap() error { return e.kind }

// ParseClaim splits "namespace/name"; ok is false for anything else (a
// Volume's name has no slash).
func ParseClaim(s string) (types.NamespacedName, bool) {
	ns, name, found := strings.Cut(s, "/")
	if !found || ns == "" || name == "" || strings.Contains(name, "/") {
		return types.NamespacedName{}, false
	}
	return types.NamespacedName{Namespace: ns, Name: name}, true
}

// VolumeOf resolves a claim to the name of its Cairn Volume (the CSI
// volume handle of its PersistentVolume). A claim that cannot be resolved
// is an error wrapping ErrNoClaim, ErrNotBound, ErrNoPersistentVolume or
// ErrOtherDriver, whose message says what to do.
func VolumeOf(ctx context.Context, r client.Reader, claim types.NamespacedName) (string, error) {
	pvc := &corev1.PersistentVolumeClaim{}
	if err := r.Get(ctx, claim, pvc); err != nil {
		if apierrors.IsNotFound(err) {
			return "", &resolveError{ErrNoClaim, fmt.Sprintf("no PersistentVolumeClaim %s in namespace %s: check the name with `kubectl -n %s get pvc` "+
				"(a claim is given as NAMESPACE/NAME; a Volume's name has no slash)", claim.Name, claim.Namespace, claim.Namespace)}
		}
		return "", fmt.Errorf("get claim %s: %w", claim, err)
	}
	if pvc.Spec.VolumeName == "" || pvc.Status.Phase != corev1.ClaimBound {
		phase := string(pvc.Status.Phase)
		if phase == "" {
			phase = string(corev1.ClaimPending)
		}
		return "", &resolveError{ErrNotBound, fmt.Sprintf("claim %s is %s, not bound to a volume yet, so it has no Cairn volume to look at: "+
			"`kubectl -n %s describe pvc %s` shows why (its StorageClass, the provisioner's events; a WaitForFirstConsumer class binds only once a pod uses the claim)",
			claim, phase, claim.Namespace, claim.Name)}
	}
	pv := &corev1.PersistentVolume{}
	if err := r.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv); err != nil {
		if apierrors.IsNotFound(err) {
			return "", &resolveError{ErrNoPersistentVolume, fmt.Sprintf("claim %s is bound to PersistentVolume %s, which does not exist (deleted while the claim lived?): "+
				"`kubectl -n %s describe pvc %s` shows the claim's state", claim, pvc.Spec.VolumeName, claim.Namespace, claim.Name)}
		}
		return "", fmt.Errorf("get PersistentVolume %s: %w", pvc.Spec.VolumeName, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != DriverName {
		return "", &resolveError{ErrOtherDriver, fmt.Sprintf("claim %s is bound to PersistentVolume %s of %s, not of Cairn's driver %s: "+
			"Cairn knows only its own volumes; ask that driver's tools, or use a claim of a Cairn StorageClass", claim, pv.Name, pvDriver(pv), DriverName)}
	}
	return pv.Spec.CSI.VolumeHandle, nil
}

func pvDriver(pv *corev1.PersistentVolume) string {
	if pv.Spec.CSI != nil {
		return "driver " + pv.Spec.CSI.Driver
	}
	return "an in-tree or non-CSI source"
}

// Ref is a claim's namespace and name, as a person writes it.
type Ref = types.NamespacedName

// ByVolume maps the name of each Cairn Volume that a PersistentVolume
// serves to its claim (spec.claimRef), for the PersistentVolumes given.
// A PersistentVolume without a claim is left out.
func ByVolume(pvs []corev1.PersistentVolume) map[string]Ref {
	out := map[string]Ref{}
	for i := range pvs {
		if ref, ok := claimOf(&pvs[i]); ok {
			out[pvs[i].Spec.CSI.VolumeHandle] = ref
		}
	}
	return out
}

// claimOf is the claim of a Cairn PersistentVolume.
func claimOf(pv *corev1.PersistentVolume) (Ref, bool) {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != DriverName || pv.Spec.ClaimRef == nil {
		return Ref{}, false
	}
	return Ref{Namespace: pv.Spec.ClaimRef.Namespace, Name: pv.Spec.ClaimRef.Name}, true
}

// List reads every PersistentVolume and maps Cairn's volumes to their
// claims (ByVolume).
func List(ctx context.Context, r client.Reader) (map[string]Ref, error) {
	var pvs corev1.PersistentVolumeList
	if err := r.List(ctx, &pvs); err != nil {
		return nil, fmt.Errorf("list PersistentVolumes: %w", err)
	}
	return ByVolume(pvs.Items), nil
}

// PersistentVolumeOf finds the Cairn PersistentVolume of a volume among
// pvs; nil if none (a Volume made by hand has none).
func PersistentVolumeOf(pvs []corev1.PersistentVolume, volume string) *corev1.PersistentVolume {
	for i := range pvs {
		if csi := pvs[i].Spec.CSI; csi != nil && csi.Driver == DriverName && csi.VolumeHandle == volume {
			return &pvs[i]
		}
	}
	return nil
}
