package csi

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/harness"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// marker is plaintext an encrypted volume's replicas must never hold.
var marker = []byte("cairn-plaintext-that-must-never-reach-a-replica-disk")

// TestEncryptedVolume provisions an encrypted volume (StorageClass
// encrypted=true, the passphrase in the provisioner secret) and an
// unencrypted one, writes files of a known text to both through ext4 on
// the real device, and scans every node's replica files: the text is on
// the unencrypted volume's replicas (so the scan can find it) and on none
// of the encrypted one's. Then: an attach with another passphrase in the
// controller-publish secret is refused; the key Secret changed to another
// passphrase makes the attach fail with FailedPrecondition saying so, and
// with the passphrase put back the data reads back on another node; a
// clone needs the source's passphrase and reads the same data; deleting
// the volumes deletes their key Secrets.
func TestEncryptedVolume(t *testing.T) {
	needRoot(t)
	g := NewWithT(t)
	nodes := []*harness.Node{cluster.AddNode(t, "enc-a"), cluster.AddNode(t, "enc-b")}
	ctrl := startDriver(t, "enc-b")
	nodeA, nodeB := startDriver(t, "enc-a"), ctrl
	ctx := callCtx(t)
	vc := volCap("ext4", false)
	pass := map[string]string{v1.EncryptionPassphraseKey: "correct horse battery staple"}
	wrong := map[string]string{v1.EncryptionPassphraseKey: "not the passphrase of this volume"}
	create := func(name string, params, secrets map[string]string, src *csipb.VolumeContentSource) (*csipb.Volume, error) {
		r, err := ctrl.controller.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{vc}, Parameters: params, Secrets: secrets, VolumeContentSource: src})
		return r.GetVolume(), err
	}
	params := map[string]string{ParamNumberOfReplicas: "2", ParamFSType: "ext4", ParamEncrypted: "true"}

	enc, err := create("pvc-enc", params, pass, nil)
	g.Expect(err).NotTo(HaveOccurred())
	plain, err := create("pvc-plain", map[string]string{ParamNumberOfReplicas: "2", ParamFSType: "ext4"}, nil, nil)
	g.Expect(err).NotTo(HaveOccurred())
	v := &v1.Volume{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: enc.GetVolumeId()}, v)).To(Succeed())
	g.Expect(v.Spec.Encryption).NotTo(BeNil())
	keySecret := &corev1.Secret{}
	g.Expect(cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: v.Spec.Encryption.KeySecret}, keySecret)).To(Succeed())
	g.Expect(string(keySecret.Data[v1.EncryptionPassphraseKey])).To(Equal(pass[v1.EncryptionPassphraseKey]))
	g.Expect(keySecret.OwnerReferences).To(ContainElement(HaveField("UID", v.UID)), "the key Secret goes with its Volume")

	a := mountOn(t, g, ctrl, nodeA, enc, vc)
	p := mountOn(t, g, ctrl, nodeA, plain, vc)
	files := writeMarked(g, a)
	writeMarked(g, p)
	g.Expect(readData(t, g, a, files)).To(Succeed())
	g.Expect(replicaFilesContaining(g, plain.GetVolumeId(), marker)).NotTo(BeEmpty(), "the unencrypted volume's replicas hold the text (the scan works)")
	g.Expect(replicaFilesContaining(g, enc.GetVolumeId(), marker)).To(BeEmpty(), "no replica of the encrypted volume holds the text")
	unmountFrom(t, g, ctrl, a, enc.GetVolumeId())
	unmountFrom(t, g, ctrl, p, plain.GetVolumeId())

	t.Log("attach with another passphrase in the controller-publish secret")
	_, err = ctrl.controller.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: enc.GetVolumeId(), NodeId: "enc-b",
		VolumeCapability: vc, Secrets: wrong})
	g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "%v", err)
	g.Expect(err.Error()).To(ContainSubstring("not the one volume " + enc.GetVolumeId() + " was created with"))
	g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(v), v)).To(Succeed())
	g.Expect(v.Spec.NodeName).To(BeEmpty(), "the refused attach changed nothing")

	t.Log("the key Secret holds another passphrase")
	setPassphrase(g, keySecret, wrong[v1.EncryptionPassphraseKey])
	pctx, cancel := context.WithTimeout(ctx, deadline.Scale(90*time.Second))
	defer cancel()
	_, err = ctrl.controller.ControllerPublishVolume(pctx, &csipb.ControllerPublishVolumeRequest{VolumeId: enc.GetVolumeId(), NodeId: "enc-b", VolumeCapability: vc})
	g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "%v", err)
	g.Expect(err.Error()).To(And(ContainSubstring("is not the one volume "+enc.GetVolumeId()+" was created with"), ContainSubstring("put the original passphrase back")))
	_, err = ctrl.controller.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: enc.GetVolumeId(), NodeId: "enc-b"})
	g.Expect(err).NotTo(HaveOccurred())
	setPassphrase(g, keySecret, pass[v1.EncryptionPassphraseKey])
	b := mountOn(t, g, ctrl, nodeB, enc, vc)
	g.Expect(readData(t, g, b, files)).To(Succeed(), "with its passphrase back the volume reads its data on another node")

	t.Log("clones")
	src := &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: enc.GetVolumeId()}}}
	_, err = create("pvc-enc-clone", params, wrong, src)
	g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument), "a clone with another passphrase: %v", err)
	_, err = create("pvc-enc-clone", map[string]string{ParamNumberOfReplicas: "2"}, nil, src)
	g.Expect(status.Code(err)).To(Equal(codes.InvalidArgument), "an unencrypted clone of an encrypted volume: %v", err)
	clone, err := create("pvc-enc-clone", params, pass, src)
	g.Expect(err).NotTo(HaveOccurred())
	c := mountOn(t, g, ctrl, nodeA, clone, vc)
	g.Expect(readData(t, g, c, files)).To(Succeed(), "the clone reads the source's data")
	g.Expect(replicaFilesContaining(g, clone.GetVolumeId(), marker)).To(BeEmpty(), "no replica of the clone holds the text")

	unmountFrom(t, g, ctrl, c, clone.GetVolumeId())
	unmountFrom(t, g, ctrl, b, enc.GetVolumeId())
	for _, id := range []string{clone.GetVolumeId(), enc.GetVolumeId(), plain.GetVolumeId()} {
		_, err = ctrl.controller.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: id})
		g.Expect(err).NotTo(HaveOccurred())
		err = cluster.Client.Get(ctx, client.ObjectKey{Namespace: testNamespace, Name: keySecretName(id)}, &corev1.Secret{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the key Secret of %s is deleted: %v", id, err)
	}
	expectNothingLeft(g, nodes)
}

// writeMarked writes two 1 MiB files of marker text and makes them durable.
func writeMarked(g *WithT, p *pod) []chunk {
	var out []chunk
	for _, name := range []string{"marked-0", "marked-1"} {
		buf := bytes.Repeat(marker, (1<<20)/len(marker))
		f, err := os.Create(filepath.Join(p.target, name))
		g.Expect(err).NotTo(HaveOccurred())
		_, err = f.Write(buf)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(f.Sync()).To(Succeed())
		g.Expect(f.Close()).To(Succeed())
		out = append(out, chunk{name: name, sum: sha256.Sum256(buf), n: len(buf)})
	}
	return out
}

// replicaFilesContaining lists the files of a volume's replicas that
// contain text.
func replicaFilesContaining(g *WithT, volume string, text []byte) []string {
	var reps v1.ReplicaList
	g.Expect(cluster.Client.List(context.Background(), &reps, client.InNamespace(testNamespace), client.MatchingLabels{labelVolume: volume})).To(Succeed())
	g.Expect(reps.Items).NotTo(BeEmpty())
	var found []string
	for _, r := range reps.Items {
		g.Expect(r.Spec.DataDirectoryName).NotTo(BeEmpty(), "replica %s is placed", r.Name)
		g.Expect(filepath.WalkDir(replica.DataDir(&r), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			if bytes.Contains(b, text) {
				found = append(found, path)
			}
			return nil
		})).To(Succeed())
	}
	return found
}

// setPassphrase puts another passphrase in a key Secret.
func setPassphrase(g *WithT, s *corev1.Secret, pass string) {
	ctx := context.Background()
	g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(s), s)).To(Succeed())
	s.Data[v1.EncryptionPassphraseKey] = []byte(pass)
	g.Expect(cluster.Client.Update(ctx, s)).To(Succeed())
}
