package engine

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// keyRecheck is how often an Engine waiting for its key looks again:
// Secrets are read, not watched (the manager caches none).
const keyRecheck = 15 * time.Second

// encryptionKey reads an encrypted volume's passphrase from its Secret and
// derives the engine's key. A key that cannot be used gives "" and a
// message saying why and what to do; err is for the API server failing.
func (r *Reconciler) encryptionKey(ctx context.Context, e *v1.Engine) (key, msg string, err error) {
	enc := e.Spec.Encryption
	ref := e.Namespace + "/" + enc.KeySecret
	s := &corev1.Secret{}
	if err := r.Secrets.Get(ctx, types.NamespacedName{Namespace: e.Namespace, Name: enc.KeySecret}, s); err != nil {
		switch {
		case apierrors.IsNotFound(err):
			return "", fmt.Sprintf("volume %s is encrypted and its key Secret %s is missing: create it with the passphrase the volume was created with (kubectl -n %s create secret generic %s --from-literal=%s=...)",
				e.Spec.VolumeName, ref, e.Namespace, enc.KeySecret, v1.EncryptionPassphraseKey), nil
		case apierrors.IsForbidden(err):
			return "", fmt.Sprintf("the manager may not read Secret %s, which holds volume %s's key: give its ServiceAccount get on secrets in %s (config/rbac/encryption_role.yaml)", ref, e.Spec.VolumeName, e.Namespace), nil
		}
		return "", "", fmt.Errorf("read the key Secret %s of volume %s: %w", ref, e.Spec.VolumeName, err)
	}
	pass, ok := s.Data[v1.EncryptionPassphraseKey]
	if !ok {
		return "", fmt.Sprintf("Secret %s has no %q: put the passphrase volume %s was created with there", ref, v1.EncryptionPassphraseKey, e.Spec.VolumeName), nil
	}
	k, err := volcrypt.DeriveKey(pass)
	if err != nil {
		return "", fmt.Sprintf("Secret %s: %v", ref, err), nil
	}
	if got := volcrypt.KeyCheck(k); got != enc.KeyCheck {
		return "", fmt.Sprintf("the passphrase in Secret %s is not the one volume %s was created with (key check %s, the volume's is %s): put the original passphrase back; data written with one key cannot be read with another",
			ref, e.Spec.VolumeName, got, enc.KeyCheck), nil
	}
	return string(k), "", nil
}
