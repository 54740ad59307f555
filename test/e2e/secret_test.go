//go:build e2e

package e2e

import (
	"fmt"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// secretNS, secretClass: the namespace and the StorageClass of the spec
// below, which deletes both.
const (
	secretNS    = "cairn-e2e-secret"
	secretClass = "cairn-e2e-secret-enc"
)

// The finalizer controllers/secretguard keeps on the Secrets Cairn's
// PersistentVolumes name.
const secretInUse = "storage.cairn.io/secret-in-use"

var _ = Describe("an encrypted claim deleted with its namespace, Secret and StorageClass", func() {
	It("leaves no PersistentVolume, Volume or Secret behind", func() {
		n := nodes()
		must("", "create", "namespace", secretNS)
		// Best effort, for a spec failed half-way: both are deleted below.
		DeferCleanup(func() {
			_, _ = kubectl("", "delete", "storageclass", secretClass, "--ignore-not-found")
			_, _ = kubectl("", "delete", "namespace", secretNS, "--ignore-not-found", "--wait=false")
		})
		must("", "-n", secretNS, "create", "secret", "generic", "enc", "--from-literal=passphrase=e2e passphrase of a namespace's own class")
		must(fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: %[1]s}
provisioner: storage.cairn.io
parameters:
  numberOfReplicas: "2"
  encrypted: "true"
  csi.storage.k8s.io/provisioner-secret-name: enc
  csi.storage.k8s.io/provisioner-secret-namespace: %[2]s
  csi.storage.k8s.io/controller-publish-secret-name: enc
  csi.storage.k8s.io/controller-publish-secret-namespace: %[2]s
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: %[2]s}
spec:
  storageClassName: %[1]s
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 64Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: writer, namespace: %[2]s}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %[4]s
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "head -c 4194304 /dev/urandom > /data/f && sync && touch /tmp/ready && sleep infinity"]
    readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
    volumeMounts: [{name: d, mountPath: /data}]
  volumes:
  - {name: d, persistentVolumeClaim: {claimName: data}}
`, secretClass, secretNS, n[1], appImage), "apply", "-f", "-")
		if _, err := kubectl("", "-n", secretNS, "wait", "pod/writer", "--for=condition=Ready", timeoutFlag(4*time.Minute)); err != nil {
			desc, _ := kubectl("", "-n", secretNS, "describe", "pod", "writer")
			Fail(fmt.Sprintf("pod writer not ready: %v\n%s", err, desc))
		}
		pv := must("", "-n", secretNS, "get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}")
		Expect(volumeField(pv, "{.spec.encryption.keyCheck}")).NotTo(BeEmpty(), "the volume is encrypted")
		Eventually(func() string {
			out, _ := kubectl("", "-n", secretNS, "get", "secret", "enc", "-o", "jsonpath={.metadata.finalizers}")
			return out
		}, deadline.Scale(time.Minute), time.Second).Should(ContainSubstring(secretInUse), "the guard holds the class's Secret")

		// As an application's manifests or a namespace are removed: all
		// at once, the claim, its pod, the Secret and the StorageClass.
		must("", "delete", "storageclass", secretClass)
		must("", "delete", "namespace", secretNS, "--wait=false")

		gone := func(args ...string) func() string {
			return func() string {
				out, err := kubectl("", append(args, "--ignore-not-found", "-o", "name")...)
				if err != nil {
					return err.Error()
				}
				return strings.TrimSpace(out)
			}
		}
		limit := deadline.Scale(5 * time.Minute)
		Eventually(gone("get", "pv", pv), limit, 2*time.Second).Should(BeEmpty(), "the PersistentVolume is detached and deleted")
		Eventually(gone("-n", ns, "get", "volumes.storage.cairn.io", pv), limit, 2*time.Second).Should(BeEmpty(), "the Volume is deleted")
		Eventually(gone("-n", ns, "get", "secret", "cairn-key-"+pv), limit, 2*time.Second).Should(BeEmpty(), "the volume's key Secret is deleted")
		Eventually(func() string {
			out, _ := kubectl("", "get", "volumeattachments.storage.k8s.io", "-o", "jsonpath={.items[*].spec.source.persistentVolumeName}")
			return out
		}, limit, 2*time.Second).ShouldNot(ContainSubstring(pv), "no VolumeAttachment of the volume is left")
		Eventually(gone("get", "namespace", secretNS), limit, 2*time.Second).Should(BeEmpty(), "the namespace, and its Secret, are gone")
	})
})
