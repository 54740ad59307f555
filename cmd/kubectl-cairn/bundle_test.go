package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
)

// startAPI starts a real API server (envtest) with Cairn's CRDs and
// returns the clients the plugin uses.
func startAPI(t *testing.T) *clients {
	t.Helper()
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: run make test")
	}
	_, file, _, _ := runtime.Caller(0)
	scheme := kruntime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := v1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	env := &envtest.Environment{CRDDirectoryPaths: []string{filepath.Join(filepath.Dir(file), "..", "..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true, Scheme: scheme}
	cfg, err := env.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Log("stop envtest:", err)
		}
	})
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return &clients{c: c, kube: kubernetes.NewForConfigOrDie(cfg), rest: cfg}
}

// TestSupportBundle writes a bundle from a real API server holding what
// a cluster with Cairn holds, Secrets included (a volume's encryption
// passphrase, the StorageClass's provisioner secret, Cairn's CA key), and
// checks that it has every part, that what the API server cannot give
// here (logs and exec need a kubelet, which envtest has none of) is a
// note, and that no Secret's value is anywhere in the archive.
func TestSupportBundle(t *testing.T) {
	cl := startAPI(t)
	c, ctx := cl.c, context.Background()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	const ns = "cairn-system"
	passphrase := "passphrase-" + rand.String(24)
	caKey := "ca-key-" + rand.String(24)
	for _, n := range []string{ns, "app"} {
		must(c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: n}}))
		must(c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "vol-key", Namespace: n},
			StringData: map[string]string{v1.EncryptionPassphraseKey: passphrase}}))
	}
	must(c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "cairn-ca", Namespace: ns}, StringData: map[string]string{"tls.key": caKey}}))

	size := resource.MustParse("1Gi")
	must(c.Create(ctx, &v1.Volume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-123", Namespace: ns}, Spec: v1.VolumeSpec{Size: size, NumberOfReplicas: 2,
		Encryption: &v1.VolumeEncryption{KeySecret: "vol-key", KeyCheck: strings.Repeat("ab", 16)}}}))
	im := &v1.InstanceManager{ObjectMeta: metav1.ObjectMeta{Name: "im-n1", Namespace: ns}, Spec: v1.InstanceManagerSpec{NodeName: "n1", Address: "10.0.0.1:8500"}}
	must(c.Create(ctx, im))
	im.Status.State, im.Status.Version = v1.InstanceManagerStateRunning, "v0.3.0-test"
	im.Status.Processes = []v1.ProcessStatus{{Name: "pvc-123-e", Kind: v1.ProcessKindEngine, State: v1.InstanceStateRunning, Ports: []int32{10000}}}
	must(c.Status().Update(ctx, im))

	pod := func(name, component, container string, restarts int32) {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app.kubernetes.io/component": component}},
			Spec: corev1.PodSpec{NodeName: "n1", Containers: []corev1.Container{{Name: container, Image: "cairn-data:test",
				Env: []corev1.EnvVar{{Name: "KEY", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
					LocalObjectReference: corev1.LocalObjectReference{Name: "vol-key"}, Key: v1.EncryptionPassphraseKey}}}}}}}}
		must(c.Create(ctx, p))
		p.Status.Phase = corev1.PodRunning
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: container, RestartCount: restarts, Image: "cairn-data:test"}}
		must(c.Status().Update(ctx, p))
	}
	pod("csi-node-abc", "csi-node", "csi", 0)
	pod("instance-manager-xyz", "instance-manager", "instance-manager", 2)

	for name, provisioner := range map[string]string{"cairn": "storage.cairn.io", "other-class": "nfs.csi.k8s.io"} {
		must(c.Create(ctx, &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: provisioner,
			Parameters: map[string]string{"csi.storage.k8s.io/provisioner-secret-name": "vol-key", "csi.storage.k8s.io/provisioner-secret-namespace": "app"}}))
	}
	for name, driver := range map[string]string{"pvc-123": "storage.cairn.io", "nfs-pv": "nfs.csi.k8s.io"} {
		must(c.Create(ctx, &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PersistentVolumeSpec{
			Capacity: corev1.ResourceList{corev1.ResourceStorage: size}, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: name}}}}))
	}
	must(c.Create(ctx, &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: "app"}, Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeName: "pvc-123", StorageClassName: ptr.To("cairn"),
		Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}}}}))
	must(c.Create(ctx, &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "csi-abc"}, Spec: storagev1.VolumeAttachmentSpec{
		Attacher: "storage.cairn.io", NodeName: "n1", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pvc-123")}}}))
	must(c.Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "vol.1", Namespace: ns}, Type: corev1.EventTypeWarning, Reason: "ReplicaFailed",
		Message: "replica pvc-123-r-1 failed", InvolvedObject: corev1.ObjectReference{Kind: "Volume", Name: "pvc-123", Namespace: ns}, LastTimestamp: metav1.Now()}))
	must(c.Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "data.1", Namespace: "app"}, Type: corev1.EventTypeWarning, Reason: v1.EventReasonVolumeDegraded,
		Message: "volume pvc-123 is degraded", InvolvedObject: corev1.ObjectReference{Kind: "PersistentVolumeClaim", Name: "data", Namespace: "app"}, LastTimestamp: metav1.Now()}))

	file := filepath.Join(t.TempDir(), "bundle.tar.gz")
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"support-bundle", file}, &out, &errb, cl); code != 0 {
		t.Fatalf("support-bundle: exit %d\n%s%s", code, out.String(), errb.String())
	}
	for _, step := range []string{"support-bundle: versions", "support-bundle: Cairn objects", "support-bundle: pod logs", "support-bundle: wrote " + file} {
		if !strings.Contains(errb.String(), step) {
			t.Errorf("no progress line %q on stderr:\n%s", step, errb.String())
		}
	}
	if strings.TrimSpace(out.String()) != file {
		t.Errorf("stdout %q, want the file's name", out.String())
	}
	files, raw := readBundle(t, file)
	has := func(name string, want ...string) {
		t.Helper()
		got, ok := files["cairn-support/"+name]
		if !ok {
			t.Errorf("no %s in the bundle (it has %v)", name, keys(files))
			return
		}
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("%s lacks %q:\n%s", name, w, got)
			}
		}
	}
	lacks := func(name, what string) {
		t.Helper()
		if strings.Contains(files["cairn-support/"+name], what) {
			t.Errorf("%s has %q", name, what)
		}
	}
	has("versions.yaml", "kubernetes: v", "im-n1: node n1, version v0.3.0-test", "cairn-data:test")
	has("objects/volumes.yaml", "name: pvc-123", "keySecret: vol-key")
	has("objects/instancemanagers.yaml", "im-n1")
	has("objects/engines.yaml")
	has("objects/storageclasses.yaml", "name: cairn")
	lacks("objects/storageclasses.yaml", "other-class")
	has("objects/persistentvolumes.yaml", "name: pvc-123")
	lacks("objects/persistentvolumes.yaml", "nfs-pv")
	has("objects/persistentvolumeclaims.yaml", "name: data")
	has("objects/volumeattachments.yaml", "csi-abc")
	has("objects/pods.yaml", "csi-node-abc", "instance-manager-xyz")
	lacks("objects/pods.yaml", "managedFields")
	has("events/cairn-system.txt", "ReplicaFailed", "volume/pvc-123")
	has("events/app.txt", v1.EventReasonVolumeDegraded, "persistentvolumeclaim/data")
	has("processes/n1_im-n1.txt", "pvc-123-e", "engine", "running", "[10000]")
	// envtest runs no kubelet: logs and exec are notes, each naming what.
	has("NOTES.txt", "No Secret is collected", "log of csi-node-abc/csi (previous: false)", "log of instance-manager-xyz/instance-manager (previous: true)",
		"mounts.txt on node n1 (exec in csi-node-abc/csi)", "disk-usage.txt on node n1 (exec in instance-manager-xyz/instance-manager)",
		"processes.txt on node n1 (exec in instance-manager-xyz/instance-manager)")
	// The index of logs: a container that never restarted has no previous
	// log, and says so; one that did has its previous log asked for.
	has("logs/containers.txt", "POD", "RESTARTS", "PREVIOUS")
	index := files["cairn-support/logs/containers.txt"]
	for _, want := range [][]string{
		{"csi-node-abc", "n1", "csi", "0", "not collected: see NOTES.txt", "none: not restarted"},
		{"instance-manager-xyz", "n1", "instance-manager", "2", "not collected: see NOTES.txt", "not collected: see NOTES.txt"},
	} {
		if !hasRow(index, want) {
			t.Errorf("logs/containers.txt has no row %q:\n%s", want, index)
		}
	}
	// As the API server gives it (base64 in data) or decoded.
	for _, secret := range []string{passphrase, caKey, base64.StdEncoding.EncodeToString([]byte(passphrase)), base64.StdEncoding.EncodeToString([]byte(caKey))} {
		if bytes.Contains(raw, []byte(secret)) || strings.Contains(out.String()+errb.String(), secret) {
			t.Errorf("a Secret's value is in the bundle or the output: %s", secret)
		}
	}

	// An existing file is not overwritten.
	if code := run(ctx, []string{"support-bundle", file}, &out, &errb, cl); code != 1 || !strings.Contains(errb.String(), "file exists") {
		t.Errorf("support-bundle over an existing file: exit %d %s", code, errb.String())
	}
}

// readBundle returns the files of a tar.gz and all its bytes, unpacked.
func readBundle(t *testing.T, file string) (map[string]string, []byte) {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(gz)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = string(b)
	}
	return files, raw
}

// hasRow tells whether a line of table holds cells, in order, each
// separated from the next by the table's padding.
func hasRow(table string, cells []string) bool {
	for _, line := range strings.Split(table, "\n") {
		rest, ok := line, true
		for _, c := range cells {
			i := strings.Index(rest, c)
			if i < 0 {
				ok = false
				break
			}
			rest = rest[i+len(c):]
		}
		if ok {
			return true
		}
	}
	return false
}

// TestExecOutputKeepsBothStreams copies two streams into one execOutput
// the way remotecommand copies a command's stdout and stderr (io.Copy in
// a goroutine each), with the empty stderr ending after stdout: all of
// stdout must be there. A bytes.Buffer in its place loses it.
func TestExecOutputKeepsBothStreams(t *testing.T) {
	var out execOutput
	stdout := strings.Repeat("36 25 0:32 / /var/lib/kubelet rw shared:1 - ext4 /dev/vda rw\n", 200)
	pr, stderrW := io.Pipe()
	stderr := &firstRead{r: pr, reading: make(chan struct{})}
	stdoutDone := make(chan struct{})
	errs := make(chan error, 2)
	go func() {
		_, err := io.Copy(&out, stderr)
		errs <- err
	}()
	go func() {
		<-stderr.reading // stderr's copy waits for its first bytes
		_, err := io.Copy(&out, strings.NewReader(stdout))
		close(stdoutDone)
		errs <- err
	}()
	<-stdoutDone
	_, _ = stderrW.Write([]byte("lsblk: not found\n"))
	stderrW.Close()
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if got, want := string(out.bytes()), stdout+"lsblk: not found\n"; got != want {
		t.Errorf("execOutput holds %d bytes, want %d (all of stdout, then stderr)", len(got), len(want))
	}
}

// firstRead closes reading when its first Read begins.
type firstRead struct {
	r       io.Reader
	reading chan struct{}
	once    sync.Once
}

func (f *firstRead) Read(p []byte) (int, error) {
	f.once.Do(func() { close(f.reading) })
	return f.r.Read(p)
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
