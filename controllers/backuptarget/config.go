package backuptarget

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// The keys of a BackupTarget's credentials Secret: the names the AWS tools
// and cairn-data's --s3-credentials-file use.
const (
	KeyAccessKeyID     = "AWS_ACCESS_KEY_ID"
	KeySecretAccessKey = "AWS_SECRET_ACCESS_KEY"
	KeySessionToken    = "AWS_SESSION_TOKEN"
)

// defaultCAKey is the CA bundle's key when the reference names none.
const defaultCAKey = "ca.crt"

// result is the outcome of one check: condition Available's status,
// reason and message.
type result struct {
	status  metav1.ConditionStatus
	reason  string
	message string
}

func failed(reason, format string, args ...any) *result {
	return &result{status: metav1.ConditionFalse, reason: reason, message: fmt.Sprintf(format, args...)}
}

// s3Config builds the store's configuration from spec and the objects it
// names. A missing object or key is a result (the user's to fix); any
// other failure to read one is an error (retried).
func (r *Reconciler) s3Config(ctx context.Context, spec *v1.S3BackupTarget) (backupstore.S3Config, *result, error) {
	cfg := backupstore.S3Config{Endpoint: spec.Endpoint, Bucket: spec.Bucket, Prefix: spec.Prefix,
		Region: spec.Region, PathStyle: spec.PathStyle, Checksum: backupstore.S3Checksum(spec.Checksum)}
	res, err := r.credentials(ctx, spec.CredentialsSecret, &cfg)
	if res != nil || err != nil {
		return cfg, res, err
	}
	if spec.CABundle != nil {
		cfg.CACertPEM, res, err = r.caBundle(ctx, *spec.CABundle)
	}
	return cfg, res, err
}

// credentials reads the access key, the secret key and the optional
// session token from the Secret ref names.
func (r *Reconciler) credentials(ctx context.Context, ref v1.SecretReference, cfg *backupstore.S3Config) (*result, error) {
	s := &corev1.Secret{}
	err := r.Reader.Get(ctx, types.NamespacedName{Namespace: ref.Namespace, Name: ref.Name}, s)
	if apierrors.IsNotFound(err) {
		return failed(v1.BackupTargetReasonCredentialsMissing,
			"credentials Secret %s/%s not found: create it with keys %s and %s (spec.s3.credentialsSecret)",
			ref.Namespace, ref.Name, KeyAccessKeyID, KeySecretAccessKey), nil
	}
	if err != nil {
		return nil, fmt.Errorf("read credentials Secret %s/%s: %w", ref.Namespace, ref.Name, err)
	}
	for _, k := range []string{KeyAccessKeyID, KeySecretAccessKey} {
		if len(s.Data[k]) == 0 {
			return failed(v1.BackupTargetReasonCredentialsMissing,
				"credentials Secret %s/%s has no key %s (or it is empty): add it", ref.Namespace, ref.Name, k), nil
		}
	}
	cfg.AccessKeyID = strings.TrimSpace(string(s.Data[KeyAccessKeyID]))
	cfg.SecretAccessKey = strings.TrimSpace(string(s.Data[KeySecretAccessKey]))
	cfg.SessionToken = strings.TrimSpace(string(s.Data[KeySessionToken]))
	return nil, nil
}

// caBundle reads the PEM bundle src names, from a Secret or a ConfigMap.
func (r *Reconciler) caBundle(ctx context.Context, src v1.CABundleSource) ([]byte, *result, error) {
	var (
		ref  v1.KeyReference
		kind string
		data map[string][]byte
		err  error
	)
	switch {
	case src.Secret != nil:
		ref, kind = *src.Secret, "Secret"
		s := &corev1.Secret{}
		err = r.Reader.Get(ctx, types.NamespacedName{Namespace: ref.Namespace, Name: ref.Name}, s)
		data = s.Data
	case src.ConfigMap != nil:
		ref, kind = *src.ConfigMap, "ConfigMap"
		cm := &corev1.ConfigMap{}
		err = r.Reader.Get(ctx, types.NamespacedName{Namespace: ref.Namespace, Name: ref.Name}, cm)
		data = map[string][]byte{}
		for k, v := range cm.Data {
			data[k] = []byte(v)
		}
		for k, v := range cm.BinaryData {
			data[k] = v
		}
	default:
		return nil, failed(v1.BackupTargetReasonCABundleInvalid, "spec.s3.caBundle names neither a Secret nor a ConfigMap"), nil
	}
	if apierrors.IsNotFound(err) {
		return nil, failed(v1.BackupTargetReasonCABundleInvalid, "CA bundle %s %s/%s not found: create it or fix spec.s3.caBundle",
			kind, ref.Namespace, ref.Name), nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read CA bundle %s %s/%s: %w", kind, ref.Namespace, ref.Name, err)
	}
	key := ref.Key
	if key == "" {
		key = defaultCAKey
	}
	if len(data[key]) == 0 {
		return nil, failed(v1.BackupTargetReasonCABundleInvalid, "CA bundle %s %s/%s has no key %s (or it is empty): add the PEM certificates under it",
			kind, ref.Namespace, ref.Name, key), nil
	}
	if !x509.NewCertPool().AppendCertsFromPEM(data[key]) {
		return nil, failed(v1.BackupTargetReasonCABundleInvalid, "CA bundle %s %s/%s key %s holds no PEM certificate",
			kind, ref.Namespace, ref.Name, key), nil
	}
	return data[key], nil, nil
}

func trimSlashes(s string) string { return strings.Trim(s, "/") }

// Config is what opening a BackupTarget's store takes: exactly one of an
// S3 and an NFS target's configuration.
type Config struct {
	S3  *backupstore.S3Config
	NFS *backupstore.NFSConfig
}

// Open returns the target cfg describes, without contacting it. Close it
// with CloseTarget when done.
func (c Config) Open() (backupstore.Target, error) {
	switch {
	case c.S3 != nil:
		return backupstore.NewS3Target(*c.S3)
	case c.NFS != nil:
		return backupstore.NewNFSTarget(*c.NFS)
	}
	return nil, errors.New("backup target: neither s3 nor nfs is set")
}

// OpenStore opens the backup store on the target cfg describes.
func (c Config) OpenStore(opts backupstore.Options) (*backupstore.Store, backupstore.Target, error) {
	tg, err := c.Open()
	if err != nil {
		return nil, nil, err
	}
	store, err := backupstore.New(tg, opts)
	if err != nil {
		CloseTarget(tg)
		return nil, nil, err
	}
	return store, tg, nil
}

// CloseTarget releases what tg holds (an NFS target's connections).
func CloseTarget(tg backupstore.Target) {
	if c, ok := tg.(io.Closer); ok {
		_ = c.Close()
	}
}

// nfsConfig is the store's configuration of an NFS target.
func nfsConfig(spec *v1.NFSBackupTarget) *backupstore.NFSConfig {
	return &backupstore.NFSConfig{Server: strings.Trim(spec.Server, "[]"), Export: spec.Path, Prefix: spec.Prefix,
		NFSPort: int(spec.Port), MountPort: int(spec.MountPort), UID: uint32(spec.UID), GID: uint32(spec.GID)}
}

// config builds the store's configuration of spec; a result when an
// object it names is missing (see s3Config).
func (r *Reconciler) config(ctx context.Context, spec v1.BackupTargetSpec) (Config, *result, error) {
	switch {
	case spec.S3 != nil:
		cfg, res, err := r.s3Config(ctx, spec.S3)
		return Config{S3: &cfg}, res, err
	case spec.NFS != nil:
		return Config{NFS: nfsConfig(spec.NFS)}, nil, nil
	}
	return Config{}, failed(v1.BackupTargetReasonProbeFailed, "the spec sets neither s3 nor nfs"), nil
}

// TargetConfig builds the backup store's configuration of a target from
// spec and, for S3, the Secret (and CA bundle) it names, read through
// rd, as the check does; backups, their deletion and restores use it. A
// missing object or key gives its reason (a BackupTarget reason) and a
// message saying what to fix; any other failure to read one is an error.
func TargetConfig(ctx context.Context, rd client.Reader, spec v1.BackupTargetSpec) (cfg Config, reason, message string, err error) {
	cfg, res, err := (&Reconciler{Reader: rd}).config(ctx, spec)
	if res != nil {
		return cfg, res.reason, res.message, nil
	}
	return cfg, "", "", err
}
