package backuptarget

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// TestSchemaRejects checks the CRD's validation on the real API server:
// each invalid BackupTarget is refused with an Invalid error naming the
// field, and nothing is stored.
func TestSchemaRejects(t *testing.T) {
	valid := func() v1.BackupTargetSpec { return s3Target("x", "https://s3.example.com", bucket, "creds").Spec }
	nfs := &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "/exports/cairn"}
	cases := []struct {
		name  string
		spec  func() v1.BackupTargetSpec
		field string
	}{
		{"both s3 and nfs", func() v1.BackupTargetSpec { s := valid(); s.NFS = nfs; return s }, "spec"},
		{"neither s3 nor nfs", func() v1.BackupTargetSpec { return v1.BackupTargetSpec{} }, "spec"},
		{"endpoint with a path", func() v1.BackupTargetSpec { s := valid(); s.S3.Endpoint = "https://s3.example.com/backups"; return s }, "spec.s3.endpoint"},
		{"endpoint not http", func() v1.BackupTargetSpec { s := valid(); s.S3.Endpoint = "ftp://s3.example.com"; return s }, "spec.s3.endpoint"},
		{"endpoint not a URL", func() v1.BackupTargetSpec { s := valid(); s.S3.Endpoint = "s3.example.com"; return s }, "spec.s3.endpoint"},
		{"bucket upper case", func() v1.BackupTargetSpec { s := valid(); s.S3.Bucket = "Backups"; return s }, "spec.s3.bucket"},
		{"bucket too short", func() v1.BackupTargetSpec { s := valid(); s.S3.Bucket = "ab"; return s }, "spec.s3.bucket"},
		{"prefix with ..", func() v1.BackupTargetSpec { s := valid(); s.S3.Prefix = "a/../b"; return s }, "spec.s3.prefix"},
		{"no credentials namespace", func() v1.BackupTargetSpec { s := valid(); s.S3.CredentialsSecret.Namespace = ""; return s }, "spec.s3.credentialsSecret.namespace"},
		{"CA bundle from both", func() v1.BackupTargetSpec {
			s := valid()
			ref := &v1.KeyReference{Name: "ca", Namespace: "default"}
			s.S3.CABundle = &v1.CABundleSource{Secret: ref, ConfigMap: ref}
			return s
		}, "spec.s3.caBundle"},
		{"poll every second", func() v1.BackupTargetSpec {
			s := valid()
			s.PollInterval = &metav1.Duration{Duration: time.Second}
			return s
		}, "spec.pollInterval"},
		{"relative NFS path", func() v1.BackupTargetSpec {
			return v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "exports"}}
		}, "spec.nfs.path"},
		{"NFS prefix with ..", func() v1.BackupTargetSpec {
			return v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "/exports", Prefix: "a/../b"}}
		}, "spec.nfs.prefix"},
		{"NFS port out of range", func() v1.BackupTargetSpec {
			return v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "/exports", Port: 70000}}
		}, "spec.nfs.port"},
		{"unknown S3 checksum", func() v1.BackupTargetSpec { s := valid(); s.S3.Checksum = "SHA1"; return s }, "spec.s3.checksum"},
		{"NFS uid negative", func() v1.BackupTargetSpec {
			return v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "/exports", UID: -1}}
		}, "spec.nfs.uid"},
		{"NFS gid past 32 bits", func() v1.BackupTargetSpec {
			return v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "10.0.0.5", Path: "/exports", GID: 1 << 32}}
		}, "spec.nfs.gid"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: unique("invalid")}, Spec: tc.spec()}
			err := k8sClient.Create(ctx, bt)
			g.Expect(apierrors.IsInvalid(err)).To(BeTrue(), "want an Invalid error, got %v", err)
			var fields []string
			if st, ok := err.(apierrors.APIStatus); ok && st.Status().Details != nil {
				for _, c := range st.Status().Details.Causes {
					fields = append(fields, c.Field)
				}
			}
			g.Expect(fields).To(ContainElement(tc.field))
			g.Expect(apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), &v1.BackupTarget{}))).To(BeTrue())
		})
	}

	t.Run("valid is accepted", func(t *testing.T) {
		// The cases above fail for their own field, not for a base that is
		// itself invalid.
		g := NewWithT(t)
		bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: unique("valid")}, Spec: valid()}
		bt.Spec.S3.CABundle = &v1.CABundleSource{Secret: &v1.KeyReference{Name: "ca", Namespace: "default"}}
		g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
		g.Expect(bt.Spec.S3.CABundle.Secret.Key).To(Equal("ca.crt"), "the API server defaults the CA key")
		g.Expect(k8sClient.Delete(ctx, bt)).To(Succeed())
	})
}

// TestNextCheck is the re-check schedule: the poll interval while
// available, a back-off from MinRetry up to it while failing.
func TestNextCheck(t *testing.T) {
	now := time.Date(2026, 11, 27, 9, 0, 0, 0, time.UTC)
	r := &Reconciler{MinRetry: 5 * time.Second}
	cases := []struct {
		name    string
		status  metav1.ConditionStatus
		failing time.Duration // since the condition last changed
		poll    *metav1.Duration
		want    time.Duration
	}{
		{"available polls", metav1.ConditionTrue, time.Hour, &metav1.Duration{Duration: time.Minute}, time.Minute},
		{"unset poll interval", metav1.ConditionTrue, 0, nil, 5 * time.Minute},
		{"just failed", metav1.ConditionFalse, 0, &metav1.Duration{Duration: time.Minute}, 5 * time.Second},
		{"failing a while", metav1.ConditionFalse, 20 * time.Second, &metav1.Duration{Duration: time.Minute}, 20 * time.Second},
		{"failing long", metav1.ConditionFalse, time.Hour, &metav1.Duration{Duration: time.Minute}, time.Minute},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bt := &v1.BackupTarget{Spec: v1.BackupTargetSpec{PollInterval: tc.poll}, Status: v1.BackupTargetStatus{
				Conditions: []metav1.Condition{{Type: v1.BackupTargetConditionAvailable, Status: tc.status,
					LastTransitionTime: metav1.Time{Time: now.Add(-tc.failing)}}}}}
			NewWithT(t).Expect(r.nextCheck(bt, now)).To(Equal(tc.want))
		})
	}
}

// TestSampleValid creates config/samples' BackupTarget with a server-side
// dry run: the API server accepts it and stores nothing.
func TestSampleValid(t *testing.T) {
	g := NewWithT(t)
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "samples", "storage_v1alpha1_backuptarget.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	bt := &v1.BackupTarget{}
	g.Expect(yaml.UnmarshalStrict(raw, bt)).To(Succeed())
	g.Expect(bt.Spec.S3).NotTo(BeNil())
	g.Expect(k8sClient.Create(ctx, bt, client.DryRunAll)).To(Succeed())
	g.Expect(apierrors.IsNotFound(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), &v1.BackupTarget{}))).To(BeTrue())
}

// TestTargetConfigNFS: the store's NFS configuration carries every field
// of spec.nfs, the identity of its calls included.
func TestTargetConfigNFS(t *testing.T) {
	spec := v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{Server: "[fd00::5]", Path: "/exports", Prefix: "c1", Port: 2049, MountPort: 20048, UID: 1234, GID: 5678}}
	cfg, reason, msg, err := TargetConfig(context.Background(), k8sClient, spec)
	if err != nil || reason != "" {
		t.Fatalf("TargetConfig: %v %s %s", err, reason, msg)
	}
	want := backupstore.NFSConfig{Server: "fd00::5", Export: "/exports", Prefix: "c1", NFSPort: 2049, MountPort: 20048, UID: 1234, GID: 5678}
	if cfg.NFS == nil || *cfg.NFS != want {
		t.Fatalf("NFS config %+v, want %+v", cfg.NFS, want)
	}
}

// TestTargetConfigS3Checksum: spec.s3.checksum reaches the store's
// configuration; unset, the store's default (MD5) applies.
func TestTargetConfigS3Checksum(t *testing.T) {
	for _, c := range []v1.S3Checksum{"", v1.S3ChecksumMD5, v1.S3ChecksumCRC32C} {
		spec := s3Target("x", "https://s3.example.com", bucket, "creds").Spec
		spec.S3.Checksum = c
		spec.S3.CredentialsSecret = v1.SecretReference{Name: "missing-creds", Namespace: "default"}
		cfg, _, _, err := TargetConfig(context.Background(), k8sClient, spec)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.S3 == nil || cfg.S3.Checksum != backupstore.S3Checksum(c) {
			t.Fatalf("checksum %q: config %+v", c, cfg.S3)
		}
	}
}
