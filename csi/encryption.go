package csi

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

// ParamEncrypted turns on encryption at rest. The passphrase comes from the
// Secret the StorageClass names with the standard parameters
// csi.storage.k8s.io/provisioner-secret-name and -namespace (the
// external-provisioner hands its data to CreateVolume), under the key
// "passphrase".
const ParamEncrypted = "encrypted"

// keySecretName is the Secret, beside the Volume, that keeps an encrypted
// volume's passphrase for the manager: the StorageClass's Secret may be
// anywhere and may change, the volume's key may not.
func keySecretName(volume string) string { return "cairn-key-" + volume }

// parseEncrypted reads the encrypted parameter's value.
func parseEncrypted(val string) (bool, error) {
	b, err := strconv.ParseBool(strings.TrimSpace(val))
	if err != nil {
		return false, status.Errorf(codes.InvalidArgument, "StorageClass parameter %s=%q: must be true or false", ParamEncrypted, val)
	}
	return b, nil
}

// passphraseCheck finds the passphrase in a request's secrets and returns
// it with its key check; what is missing or unusable is InvalidArgument
// saying where it should come from.
func passphraseCheck(secrets map[string]string, where string) (pass, check string, err error) {
	pass, ok := secrets[v1.EncryptionPassphraseKey]
	if !ok {
		return "", "", status.Errorf(codes.InvalidArgument, "an encrypted volume needs a passphrase: put it under the key %q of a Secret and name that Secret in the StorageClass's %s-secret-name and %s-secret-namespace parameters",
			v1.EncryptionPassphraseKey, provisionerPrefix+where, provisionerPrefix+where)
	}
	key, err := volcrypt.DeriveKey([]byte(pass))
	if err != nil {
		return "", "", status.Errorf(codes.InvalidArgument, "the passphrase in the StorageClass's %s secret: %v", where, err)
	}
	return pass, volcrypt.KeyCheck(key), nil
}

// encryption decides a new volume's encryption: from the request's
// secrets when the StorageClass asks for it, and the same key as its
// source for a clone (a clone copies the source's ciphertext).
func encryption(name string, encrypted bool, secrets map[string]string, source *v1.Volume) (*v1.VolumeEncryption, string, error) {
	var enc *v1.VolumeEncryption
	var pass string
	if encrypted {
		p, check, err := passphraseCheck(secrets, "provisioner")
		if err != nil {
			return nil, "", err
		}
		pass, enc = p, &v1.VolumeEncryption{KeySecret: keySecretName(name), KeyCheck: check}
	}
	if source == nil {
		return enc, pass, nil
	}
	se := source.Spec.Encryption
	switch {
	case se == nil && enc != nil:
		return nil, "", status.Errorf(codes.InvalidArgument, "volume %s is not encrypted, so a copy of it cannot be: a clone copies its source's bytes as they are. Use a StorageClass without %s=true, or copy the data at the file level into a new encrypted volume", source.Name, ParamEncrypted)
	case se != nil && enc == nil:
		return nil, "", status.Errorf(codes.InvalidArgument, "volume %s is encrypted, so a copy of it must be too, with the same passphrase: use a StorageClass with %s=true whose provisioner secret holds that passphrase", source.Name, ParamEncrypted)
	case se != nil && se.KeyCheck != enc.KeyCheck:
		return nil, "", status.Errorf(codes.InvalidArgument, "the StorageClass's passphrase is not the one volume %s was encrypted with (key check %s, the source's is %s): a clone holds the source's ciphertext, so it needs the source's passphrase",
			source.Name, enc.KeyCheck, se.KeyCheck)
	}
	return enc, pass, nil
}

// ensureKeySecret makes (or brings up to date, while the volume does not
// exist yet) the Secret that holds a new encrypted volume's passphrase.
func (s *ControllerServer) ensureKeySecret(ctx context.Context, volume, pass string) error {
	want := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: keySecretName(volume), Namespace: s.ns, Labels: map[string]string{labelVolume: volume}},
		Data: map[string][]byte{v1.EncryptionPassphraseKey: []byte(pass)}, Type: corev1.SecretTypeOpaque}
	have := &corev1.Secret{}
	err := s.c.Get(ctx, client.ObjectKeyFromObject(want), have)
	switch {
	case apierrors.IsNotFound(err):
		if err := s.c.Create(ctx, want); err != nil && !apierrors.IsAlreadyExists(err) {
			return apiError(err)
		}
		return nil
	case err != nil:
		return apiError(err)
	}
	if string(have.Data[v1.EncryptionPassphraseKey]) == pass {
		return nil
	}
	have.Data = want.Data
	if err := s.c.Update(ctx, have); err != nil {
		return apiError(err)
	}
	return nil
}

// ownKeySecret makes the Volume the owner of its key Secret, so that the
// Secret goes when the Volume does.
func (s *ControllerServer) ownKeySecret(ctx context.Context, v *v1.Volume) error {
	sec := &corev1.Secret{}
	if err := s.c.Get(ctx, client.ObjectKey{Namespace: s.ns, Name: v.Spec.Encryption.KeySecret}, sec); err != nil {
		return apiError(err)
	}
	for _, o := range sec.OwnerReferences {
		if o.UID == v.UID {
			return nil
		}
	}
	patch := client.MergeFrom(sec.DeepCopy())
	sec.OwnerReferences = append(sec.OwnerReferences, metav1.OwnerReference{APIVersion: v1.GroupVersion.String(), Kind: "Volume", Name: v.Name, UID: v.UID})
	if err := s.c.Patch(ctx, sec, patch); err != nil {
		return apiError(err)
	}
	return nil
}

// deleteKeySecret deletes a deleted volume's key Secret (the owner
// reference does too, unless the driver stopped before setting it).
func (s *ControllerServer) deleteKeySecret(ctx context.Context, volume string) error {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: keySecretName(volume), Namespace: s.ns}}
	if err := s.c.Delete(ctx, sec); err != nil && !apierrors.IsNotFound(err) {
		return apiError(err)
	}
	return nil
}

// checkPublishKey refuses to attach an encrypted volume when the request
// carries a passphrase (the StorageClass names a controller-publish
// secret) that is not the volume's.
func checkPublishKey(v *v1.Volume, secrets map[string]string) error {
	if v.Spec.Encryption == nil {
		return nil
	}
	if _, ok := secrets[v1.EncryptionPassphraseKey]; !ok {
		return nil
	}
	_, check, err := passphraseCheck(secrets, "controller-publish")
	if err != nil {
		return status.Error(codes.FailedPrecondition, status.Convert(err).Message())
	}
	if check != v.Spec.Encryption.KeyCheck {
		return status.Errorf(codes.FailedPrecondition, "the passphrase in the StorageClass's controller-publish secret is not the one volume %s was created with (key check %s, the volume's is %s): put the original passphrase back in that Secret; data written with one key cannot be read with another",
			v.Name, check, v.Spec.Encryption.KeyCheck)
	}
	return nil
}

// keyUnusable is the reason an encrypted volume cannot attach, from its
// Ready condition, or "".
func keyUnusable(v *v1.Volume) string {
	for _, c := range v.Status.Conditions {
		if c.Type == v1.ConditionReady && c.Status != metav1.ConditionTrue && c.Reason == v1.ReasonEncryptionKeyUnusable {
			return fmt.Sprintf("volume %s cannot attach: %s", v.Name, c.Message)
		}
	}
	return ""
}
