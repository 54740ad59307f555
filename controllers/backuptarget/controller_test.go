package backuptarget

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
	"github.com/cairn-io/cairn/dataplane/testutil/nfsserver"
)

var (
	waitFor = deadline.Scale(60 * time.Second)
	ctx     = context.Background()
	seq     atomic.Int64
)

const ns = "cairn-system"

// unique returns a fresh object name (the API server is the suite's own).
func unique(base string) string { return fmt.Sprintf("%s-%d", base, seq.Add(1)) }

func ensureNamespace(g Gomega) {
	err := k8sClient.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	if !apierrors.IsAlreadyExists(err) {
		g.Expect(err).To(Succeed())
	}
}

// credentialsSecret creates a Secret with the given keys.
func credentialsSecret(g Gomega, name string, data map[string]string) {
	ensureNamespace(g)
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, StringData: data}
	g.Expect(k8sClient.Create(ctx, s)).To(Succeed())
}

func goodCredentials() map[string]string {
	return map[string]string{KeyAccessKeyID: s3.access, KeySecretAccessKey: s3.secret}
}

// s3Target returns a BackupTarget for the test server's bucket under
// prefix, with credentials from Secret secret.
func s3Target(name, endpoint, bkt, secret string) *v1.BackupTarget {
	return &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{S3: &v1.S3BackupTarget{
		Endpoint: endpoint, Bucket: bkt, Prefix: "cluster-" + name, Region: "us-east-1", PathStyle: true,
		CredentialsSecret: v1.SecretReference{Name: secret, Namespace: ns},
	}}}
}

// waitAvailable waits until bt's Available condition has reason and
// returns it.
func waitAvailable(g Gomega, name, reason string) metav1.Condition {
	var got metav1.Condition
	g.Eventually(func(g Gomega) {
		bt := &v1.BackupTarget{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKey{Name: name}, bt)).To(Succeed())
		c := meta.FindStatusCondition(bt.Status.Conditions, v1.BackupTargetConditionAvailable)
		g.Expect(c).NotTo(BeNil())
		g.Expect(c.Reason).To(Equal(reason), c.Message)
		got = *c
	}, waitFor, 50*time.Millisecond).Should(Succeed())
	return got
}

// probeObjects lists what the check left under the target's probe folder.
func probeObjects(g Gomega, prefix string) []string {
	var keys []string
	for o := range s3.client.ListObjects(ctx, bucket, minio.ListObjectsOptions{Prefix: prefix + "/", Recursive: true}) {
		g.Expect(o.Err).NotTo(HaveOccurred())
		keys = append(keys, o.Key)
	}
	return keys
}

func TestAvailable(t *testing.T) {
	g := NewWithT(t)
	name := unique("good")
	credentialsSecret(g, name, goodCredentials())
	bt := s3Target(name, s3.endpoint, bucket, name)
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())

	c := waitAvailable(g, name, v1.BackupTargetReasonAvailable)
	g.Expect(c.Status).To(Equal(metav1.ConditionTrue))
	g.Expect(c.Message).To(ContainSubstring(bucket + "/cluster-" + name + "/" + ProbeDir))
	got := &v1.BackupTarget{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), got)).To(Succeed())
	g.Expect(got.Status.Type).To(Equal(v1.BackupTargetTypeS3))
	g.Expect(got.Status.URL).To(Equal("s3://" + bucket + "/cluster-" + name + " at " + s3.endpoint))
	g.Expect(got.Status.LastCheckTime).NotTo(BeNil())
	g.Expect(got.Status.ObservedGeneration).To(Equal(got.Generation))
	g.Expect(got.Spec.PollInterval.Duration).To(Equal(5*time.Minute), "the API server defaults pollInterval")
	// The probe object was deleted: the check leaves nothing on the target.
	g.Expect(probeObjects(g, "cluster-"+name)).To(BeEmpty())
}

func TestWrongSecretKeyThenFixed(t *testing.T) {
	g := NewWithT(t)
	name := unique("wrongkey")
	credentialsSecret(g, name, map[string]string{KeyAccessKeyID: s3.access, KeySecretAccessKey: "not-the-secret"})
	g.Expect(k8sClient.Create(ctx, s3Target(name, s3.endpoint, bucket, name))).To(Succeed())

	c := waitAvailable(g, name, v1.BackupTargetReasonAccessDenied)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring("Secret " + ns + "/" + name))
	g.Expect(c.Message).To(ContainSubstring(KeySecretAccessKey))

	// Fixing the Secret is seen by the next check (back-off from 1 s here).
	s := &corev1.Secret{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, s)).To(Succeed())
	s.Data[KeySecretAccessKey] = []byte(s3.secret)
	g.Expect(k8sClient.Update(ctx, s)).To(Succeed())
	g.Expect(waitAvailable(g, name, v1.BackupTargetReasonAvailable).Status).To(Equal(metav1.ConditionTrue))
}

func TestCredentialsMissing(t *testing.T) {
	g := NewWithT(t)
	name := unique("nosecret")
	ensureNamespace(g)
	g.Expect(k8sClient.Create(ctx, s3Target(name, s3.endpoint, bucket, name))).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonCredentialsMissing)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring(ns + "/" + name + " not found"))

	// A Secret without the secret key is still missing credentials, and
	// the message names the key.
	credentialsSecret(g, name, map[string]string{KeyAccessKeyID: s3.access})
	g.Eventually(func(g Gomega) {
		c := waitAvailable(g, name, v1.BackupTargetReasonCredentialsMissing)
		g.Expect(c.Message).To(ContainSubstring("has no key " + KeySecretAccessKey))
	}, waitFor, 50*time.Millisecond).Should(Succeed())

	s := &corev1.Secret{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, s)).To(Succeed())
	s.Data[KeySecretAccessKey] = []byte(s3.secret)
	g.Expect(k8sClient.Update(ctx, s)).To(Succeed())
	g.Expect(waitAvailable(g, name, v1.BackupTargetReasonAvailable).Status).To(Equal(metav1.ConditionTrue))
}

func TestBucketNotFound(t *testing.T) {
	g := NewWithT(t)
	name := unique("nobucket")
	credentialsSecret(g, name, goodCredentials())
	g.Expect(k8sClient.Create(ctx, s3Target(name, s3.endpoint, "no-such-bucket", name))).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonBucketNotFound)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring(`bucket "no-such-bucket" does not exist`))
}

func TestUnreachable(t *testing.T) {
	g := NewWithT(t)
	ensureNamespace(g)

	t.Run("nobody listens", func(t *testing.T) {
		g := NewWithT(t)
		port, err := freePort()
		g.Expect(err).NotTo(HaveOccurred())
		name := unique("refused")
		credentialsSecret(g, name, goodCredentials())
		endpoint := "http://127.0.0.1:" + strconv.Itoa(port)
		g.Expect(k8sClient.Create(ctx, s3Target(name, endpoint, bucket, name))).To(Succeed())
		c := waitAvailable(g, name, v1.BackupTargetReasonUnreachable)
		g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
		g.Expect(c.Message).To(ContainSubstring("cannot reach " + endpoint))
	})

	t.Run("stalled server", func(t *testing.T) {
		// A server that accepts connections and never answers: only the
		// probe's timeout ends the check.
		g := NewWithT(t)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		g.Expect(err).NotTo(HaveOccurred())
		var conns []net.Conn
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				conns = append(conns, c)
			}
		}()
		t.Cleanup(func() {
			_ = l.Close()
			<-done
			for _, c := range conns {
				_ = c.Close()
			}
		})
		name := unique("stalled")
		credentialsSecret(g, name, goodCredentials())
		endpoint := "http://" + l.Addr().String()
		g.Expect(k8sClient.Create(ctx, s3Target(name, endpoint, bucket, name))).To(Succeed())
		c := waitAvailable(g, name, v1.BackupTargetReasonUnreachable)
		g.Expect(c.Message).To(ContainSubstring("no answer from " + endpoint + " within " + probeTimeout.String()))
	})
}

func TestCABundleInvalid(t *testing.T) {
	g := NewWithT(t)
	name := unique("ca")
	credentialsSecret(g, name, goodCredentials())
	bt := s3Target(name, s3.endpoint, bucket, name)
	bt.Spec.S3.CABundle = &v1.CABundleSource{ConfigMap: &v1.KeyReference{Name: name, Namespace: ns}}
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonCABundleInvalid)
	g.Expect(c.Message).To(ContainSubstring("ConfigMap " + ns + "/" + name + " not found"))

	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Data: map[string]string{"ca.crt": "not a certificate"}}
	g.Expect(k8sClient.Create(ctx, cm)).To(Succeed())
	g.Eventually(func(g Gomega) {
		c := waitAvailable(g, name, v1.BackupTargetReasonCABundleInvalid)
		g.Expect(c.Message).To(ContainSubstring("holds no PEM certificate"))
	}, waitFor, 50*time.Millisecond).Should(Succeed())
}

// nfsTarget starts a user-space NFS server (go-nfs) over a temporary
// directory and returns a BackupTarget for its export and the directory.
func nfsTarget(t *testing.T, name string, opts nfsserver.Options) (*v1.BackupTarget, string) {
	t.Helper()
	if opts.Dir == "" {
		opts.Dir = t.TempDir()
	}
	srv, err := nfsserver.Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{
		Server: srv.Host, Path: srv.Export, Prefix: "cluster-" + name, Port: int32(srv.Port), MountPort: int32(srv.Port)}}}, opts.Dir
}

// TestNFSAvailable: an NFS target is checked like an S3 one, over NFSv3
// from user space against a real server: the probe file is written, read
// back and deleted under the prefix directory, which the check created.
func TestNFSAvailable(t *testing.T) {
	g := NewWithT(t)
	name := unique("nfs")
	bt, dir := nfsTarget(t, name, nfsserver.Options{})
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonAvailable)
	g.Expect(c.Status).To(Equal(metav1.ConditionTrue))
	g.Expect(c.Message).To(ContainSubstring("nfs://127.0.0.1" + bt.Spec.NFS.Path + "/cluster-" + name + "/" + ProbeDir))
	got := &v1.BackupTarget{}
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), got)).To(Succeed())
	g.Expect(got.Status.Type).To(Equal(v1.BackupTargetTypeNFS))
	g.Expect(got.Status.URL).To(Equal("nfs://127.0.0.1" + bt.Spec.NFS.Path + "/cluster-" + name))
	g.Expect(got.Status.LastCheckTime).NotTo(BeNil())
	probes, err := os.ReadDir(filepath.Join(dir, "cluster-"+name, strings.TrimSuffix(ProbeDir, "/")))
	g.Expect(err).NotTo(HaveOccurred(), "the check made the probe folder on the export")
	g.Expect(probes).To(BeEmpty(), "the probe file was deleted")
}

// TestNFSExportNotFound: a path the server does not export, then fixed.
func TestNFSExportNotFound(t *testing.T) {
	g := NewWithT(t)
	name := unique("nfs-noexport")
	bt, _ := nfsTarget(t, name, nfsserver.Options{})
	export := bt.Spec.NFS.Path
	bt.Spec.NFS.Path = "/no/such/export"
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonExportNotFound)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring("/no/such/export"))

	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), bt)).To(Succeed())
	bt.Spec.NFS.Path = export
	g.Expect(k8sClient.Update(ctx, bt)).To(Succeed())
	waitAvailable(g, name, v1.BackupTargetReasonAvailable)
}

// TestNFSAccessDenied: a server that refuses to mount the export for
// this client (as one whose export does not list the manager's pods).
func TestNFSAccessDenied(t *testing.T) {
	g := NewWithT(t)
	name := unique("nfs-refused")
	bt, _ := nfsTarget(t, name, nfsserver.Options{Refuse: true})
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonAccessDenied)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring("insecure"))
}

// TestNFSUnreachable: nothing listens at the NFS server's ports.
func TestNFSUnreachable(t *testing.T) {
	g := NewWithT(t)
	name := unique("nfs-down")
	port, err := freePort()
	g.Expect(err).NotTo(HaveOccurred())
	bt := &v1.BackupTarget{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.BackupTargetSpec{NFS: &v1.NFSBackupTarget{
		Server: "127.0.0.1", Path: "/export", Port: int32(port), MountPort: int32(port)}}}
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonUnreachable)
	g.Expect(c.Message).To(ContainSubstring("NFS server 127.0.0.1"))
}

// TestNotWritable: credentials that may list the bucket and read from it
// but not write (a versitygw user given only those by a bucket policy).
func TestNotWritable(t *testing.T) {
	g := NewWithT(t)
	const user, userSecret = "cairn-reader", "cairn-reader-secret"
	out, err := exec.Command(s3.bin, "admin", "--access", s3.access, "--secret", s3.secret, "--endpoint-url", s3.endpoint,
		"create-user", "--access", user, "--secret", userSecret, "--role", "user").CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "versitygw admin create-user: %s", out)
	policy := fmt.Sprintf(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":[%q]},`+
		`"Action":["s3:ListBucket","s3:GetObject"],"Resource":["arn:aws:s3:::%s","arn:aws:s3:::%s/*"]}]}`, user, bucket, bucket)
	g.Expect(s3.client.SetBucketPolicy(ctx, bucket, policy)).To(Succeed())
	t.Cleanup(func() { _ = s3.client.SetBucketPolicy(ctx, bucket, "") })

	name := unique("readonly")
	credentialsSecret(g, name, map[string]string{KeyAccessKeyID: user, KeySecretAccessKey: userSecret})
	g.Expect(k8sClient.Create(ctx, s3Target(name, s3.endpoint, bucket, name))).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonNotWritable)
	g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
	g.Expect(c.Message).To(ContainSubstring("may list bucket %q but not write", bucket))
	g.Expect(probeObjects(g, "cluster-"+name)).To(BeEmpty())
}

// TestCustomCA: an HTTPS endpoint whose certificate a private CA signed is
// Unreachable (untrusted) until caBundle names that CA, then Available.
func TestCustomCA(t *testing.T) {
	g := NewWithT(t)
	name := unique("tls")
	credentialsSecret(g, name, goodCredentials())
	bt := s3Target(name, s3tls.endpoint, bucket, name)
	g.Expect(k8sClient.Create(ctx, bt)).To(Succeed())
	c := waitAvailable(g, name, v1.BackupTargetReasonUnreachable)
	g.Expect(c.Message).To(ContainSubstring("does not present a certificate this manager trusts"))

	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Data: map[string]string{"ca.crt": string(s3tls.caPEM)}}
	g.Expect(k8sClient.Create(ctx, cm)).To(Succeed())
	g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(bt), bt)).To(Succeed())
	bt.Spec.S3.CABundle = &v1.CABundleSource{ConfigMap: &v1.KeyReference{Name: name, Namespace: ns}}
	g.Expect(k8sClient.Update(ctx, bt)).To(Succeed())
	g.Expect(waitAvailable(g, name, v1.BackupTargetReasonAvailable).Status).To(Equal(metav1.ConditionTrue))
}
