//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// wffcClass is a StorageClass whose claims wait for their pod
// (WaitForFirstConsumer): kube-scheduler places the pod first, and would
// check the claim against CSIStorageCapacity objects if the CSIDriver
// asked it to (storageCapacity: true).
const wffcClass = "cairn-e2e-wffc"

// overSize is larger than any disk the e2e cluster has (checked before it
// is used) and smaller than 64 TiB, the largest volume CreateVolume
// serves, so the refusal is the one for room, not for size.
const overSize = "63Ti"

// scheduledPod starts a pod with claim at /data and no nodeName, so that
// kube-scheduler, and with it the volume binding, places it.
func scheduledPod(name, claim string) {
	GinkgoHelper()
	y := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo fits > /data/f && sync && touch /tmp/ready && sleep infinity"]
    readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
    volumeMounts: [{name: d, mountPath: /data}]
  volumes:
  - {name: d, persistentVolumeClaim: {claimName: %s}}
`, name, appImage, claim)
	must(y, "apply", "-f", "-")
	DeferCleanup(func() { _, _ = kubectl("", "-n", "default", "delete", "pod", name, "--wait=true", "--timeout=2m") })
}

// eventsOf are the messages of the object's events with reason, matched
// by UID: events of an earlier object of the same name outlive it.
func eventsOf(kind, name, reason string) string {
	uid, err := kubectl("", "-n", "default", "get", kind, name, "-o", "jsonpath={.metadata.uid}")
	if err != nil || uid == "" {
		return ""
	}
	out, _ := kubectl("", "-n", "default", "get", "events",
		"--field-selector", "involvedObject.uid="+uid+",reason="+reason,
		"-o", `jsonpath={range .items[*]}{.message}{"\n"}{end}`)
	return out
}

// largestDisk is the capacity in bytes of the largest disk any
// StorageNode reports.
func largestDisk() int64 {
	GinkgoHelper()
	var list struct {
		Items []struct {
			Status struct {
				Disks []struct {
					Capacity resource.Quantity `json:"capacity"`
				} `json:"disks"`
			} `json:"status"`
		} `json:"items"`
	}
	Expect(json.Unmarshal([]byte(must("", "-n", ns, "get", "storagenodes.storage.cairn.io", "-o", "json")), &list)).To(Succeed())
	var largest int64
	for _, n := range list.Items {
		for _, d := range n.Status.Disks {
			largest = max(largest, d.Capacity.Value())
		}
	}
	Expect(largest).To(BeNumerically(">", 0), "the StorageNodes report their disks")
	return largest
}

// volumesOfClaim names the Volumes CreateVolume made for the claim
// ("namespace/name", the storage.cairn.io/pvc annotation).
func volumesOfClaim(claim string) []string {
	GinkgoHelper()
	var list struct {
		Items []struct {
			Metadata struct {
				Name        string            `json:"name"`
				Annotations map[string]string `json:"annotations"`
			} `json:"metadata"`
		} `json:"items"`
	}
	Expect(json.Unmarshal([]byte(must("", "-n", ns, "get", "volumes.storage.cairn.io", "-o", "json")), &list)).To(Succeed())
	var of []string
	for _, v := range list.Items {
		if v.Metadata.Annotations["storage.cairn.io/pvc"] == claim {
			of = append(of, v.Metadata.Name)
		}
	}
	return of
}

// Cairn publishes no CSIStorageCapacity (docs/csi.md, Storage capacity):
// the scheduler places a WaitForFirstConsumer pod without asking about
// room, and CreateVolume is what refuses a claim no disk set can hold.
// This spec holds both halves of that: a claim that fits is never kept
// waiting for capacity information, and one that does not fit leaves its
// pod Pending with the reason on the claim.
var _ = Describe("a WaitForFirstConsumer claim", func() {
	It("binds and runs when it fits; when larger than any room, its pod stays Pending and the claim says why", func() {
		must(fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: %s}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "2"}
volumeBindingMode: WaitForFirstConsumer
`, wffcClass), "apply", "-f", "-")
		DeferCleanup(func() { _, _ = kubectl("", "delete", "storageclass", wffcClass) })

		By("a claim that fits: bound once the scheduler places its pod, and the pod runs")
		pvc("cap-fits", wffcClass, "64Mi", false, "")
		scheduledPod("cap-fits", "cap-fits")
		waitPod("cap-fits", 4*time.Minute)
		Expect(must("", "-n", "default", "get", "pvc", "cap-fits", "-o", "jsonpath={.status.phase}")).To(Equal("Bound"))
		Expect(podExec("cap-fits", "cat /data/f")).To(Equal("fits"))
		Expect(eventsOf("Pod", "cap-fits", "FailedScheduling")).NotTo(ContainSubstring("enough free storage"),
			"placed without waiting for capacity objects")

		By("a claim larger than any room: refused by CreateVolume, the pod Pending on no node")
		over := resource.MustParse(overSize)
		Expect(over.Value()).To(BeNumerically(">", 4*largestDisk()),
			"%s must be more than any disk holds, even over-provisioned", overSize)
		pvc("cap-big", wffcClass, overSize, false, "")
		scheduledPod("cap-big", "cap-big")
		Eventually(func() string { return eventsOf("PersistentVolumeClaim", "cap-big", "ProvisioningFailed") }, deadline.Scale(3*time.Minute), 2*time.Second).
			Should(ContainSubstring("ResourceExhausted"), "the claim names why it is not provisioned")
		Expect(eventsOf("PersistentVolumeClaim", "cap-big", "ProvisioningFailed")).To(ContainSubstring("can be placed"))
		Expect(must("", "-n", "default", "get", "pvc", "cap-big", "-o", "jsonpath={.status.phase} {.spec.volumeName}")).To(Equal("Pending"))
		Expect(must("", "-n", "default", "get", "pod", "cap-big", "-o", "jsonpath={.status.phase} {.spec.nodeName}")).To(Equal("Pending"))
		Expect(must("", "-n", "default", "get", "pvc", "cap-big", "-o", `jsonpath={.metadata.annotations.volume\.kubernetes\.io/selected-node}`)).
			NotTo(BeEmpty(), "the scheduler chose a node without asking about room; the provisioner keeps it (no topology, no rescheduling)")
		GinkgoWriter.Printf("cap-big's scheduling: %s\n", eventsOf("Pod", "cap-big", "FailedScheduling"))
		// The Volume of each refused attempt is withdrawn: nothing of the
		// claim stays on the disks.
		Eventually(func() []string { return volumesOfClaim("default/cap-big") }, deadline.Scale(2*time.Minute), 2*time.Second).Should(BeEmpty())
	})
})
