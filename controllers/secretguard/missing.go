package secretguard

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/objects"
)

// reportMissing records, on each PersistentVolume in users and on its
// claim if it still exists, and on each VolumeSnapshotContent in users and
// on its VolumeSnapshot if it still exists, that secret does not exist. The cache may not
// have seen a Secret just made yet, so the API server is asked first; a
// Secret it has is left to its create event. Repeated reports of the same
// trouble fold into one Event with a count (the API server's event
// series).
func (r *Reconciler) reportMissing(ctx context.Context, secret types.NamespacedName, u users) error {
	switch err := r.Reader.Get(ctx, secret, secretMeta()); {
	case err == nil:
		return nil
	case !apierrors.IsNotFound(err):
		return fmt.Errorf("read Secret %s: %w", secret, err)
	}
	log := ctrl.LoggerFrom(ctx)
	log.Info("a Secret that PersistentVolumes or VolumeSnapshotContents name does not exist", u.keysAndValues()...)
	for i := range u.pvs {
		pv := &u.pvs[i]
		note := missingNote(secret, kindPV, pv.Name, rolesOf(pv, r.Driver, secret))
		objects.Event(r.Recorder, pv, true, v1.EventReasonSecretMissing, "CheckSecret", "%s", note)
		if claim := r.claimOf(ctx, pv); claim != nil {
			objects.Event(r.Recorder, claim, true, v1.EventReasonSecretMissing, "CheckSecret", "%s", note)
		}
	}
	r.reportMissingOnContents(ctx, secret, u.contents)
	return nil
}

// claimOf returns pv's claim if it still exists (the same object the
// PersistentVolume was bound to, by UID), else nil. A claim that cannot
// be read is logged and skipped: the report on the PersistentVolume is
// what matters.
func (r *Reconciler) claimOf(ctx context.Context, pv *corev1.PersistentVolume) *corev1.PersistentVolumeClaim {
	ref := pv.Spec.ClaimRef
	if ref == nil || ref.Name == "" {
		return nil
	}
	claim := &corev1.PersistentVolumeClaim{}
	if err := r.Reader.Get(ctx, client.ObjectKey{Namespace: ref.Namespace, Name: ref.Name}, claim); err != nil {
		if !apierrors.IsNotFound(err) {
			ctrl.LoggerFrom(ctx).Error(err, "read the claim of a PersistentVolume", "persistentVolume", pv.Name)
		}
		return nil
	}
	if ref.UID != "" && claim.UID != ref.UID {
		return nil
	}
	return claim
}

// noteLimit is the most an Event's note may hold (the API server
// refuses longer ones).
const noteLimit = 1024

// The kinds of object that name Secrets, as missingNote writes them.
const (
	kindPV      = "PersistentVolume"
	kindContent = "VolumeSnapshotContent"
)

// missingNote is the Event's message: which Secret, for what (a Secret
// named by the object of kind named name, in roles), what waits on it,
// and the fix. A Secret named in many roles, or long names, drop the
// sidecars' part, and at worst the end, to stay within noteLimit.
func missingNote(secret types.NamespacedName, kind, name string, roles []Role) string {
	kinds := make([]string, 0, len(roles))
	var readers []string
	for _, r := range roles {
		kinds = append(kinds, string(r))
		if rd := r.reader(); !slices.Contains(readers, rd) {
			readers = append(readers, rd)
		}
	}
	needless, goesOn := "detach or delete the volume", "the volume's detach and deletion then go on"
	if kind == kindContent {
		needless, goesOn = "delete the snapshot", "the snapshot's deletion then goes on"
	}
	head := fmt.Sprintf("Secret %s, the %s secret of %s %s, does not exist", secret, strings.Join(kinds, " and "), kind, name)
	tail := fmt.Sprintf("Cairn's driver does not need its content to %s. "+
		"Fix: kubectl -n %s create secret generic %s (an empty Secret will do); %s, "+
		"and Cairn keeps that Secret until the %s is gone.", needless, secret.Namespace, secret.Name, goesOn, kind)
	note := head + ": " + strings.Join(readers, "; ") + ". " + tail
	if len(note) > noteLimit {
		note = head + ". " + tail
	}
	if len(note) > noteLimit {
		note = note[:noteLimit-3] + "..."
	}
	return note
}
