//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// wffcClass is a StorageClass whose claims wait for their pod
// (WaitForFirstConsumer): kube-scheduler places the pod first, checking
// the claim against the class's CSIStorageCapacity objects (the CSIDriver
// has storageCapacity: true).
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

// capacityObject is the one CSIStorageCapacity the external-provisioner
// publishes for a StorageClass of Cairn's, as the scheduler reads it.
type capacityObject struct {
	UID               string
	NodeTopology      map[string]string
	MaximumVolumeSize int64
}

// capacityOf returns the class's CSIStorageCapacity objects in Cairn's
// namespace.
func capacityOf(class string) []capacityObject {
	GinkgoHelper()
	var list struct {
		Items []struct {
			Metadata struct {
				UID string `json:"uid"`
			} `json:"metadata"`
			StorageClassName string `json:"storageClassName"`
			NodeTopology     *struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"nodeTopology"`
			MaximumVolumeSize *resource.Quantity `json:"maximumVolumeSize"`
		} `json:"items"`
	}
	Expect(json.Unmarshal([]byte(must("", "-n", ns, "get", "csistoragecapacities",
		"-l", "csi.storage.k8s.io/drivername=storage.cairn.io", "-o", "json")), &list)).To(Succeed())
	var of []capacityObject
	for _, c := range list.Items {
		if c.StorageClassName != class {
			continue
		}
		o := capacityObject{UID: c.Metadata.UID}
		if c.NodeTopology != nil {
			o.NodeTopology = c.NodeTopology.MatchLabels
		}
		if c.MaximumVolumeSize != nil {
			o.MaximumVolumeSize = c.MaximumVolumeSize.Value()
		}
		of = append(of, o)
	}
	return of
}

// capacityPoll is the external-provisioner's --capacity-poll-interval
// (its default): an object that stays longer than this has survived a
// poll.
const capacityPoll = time.Minute

// Cairn publishes one CSIStorageCapacity per WaitForFirstConsumer class,
// for the node plugin's topology segment (docs/csi.md, Storage capacity):
// the scheduler places a pod whose claim fits, and keeps a pod whose claim
// does not fit off every node, so that the provisioner is never asked.
// The object must stay (it survives the provisioner's polls), and the
// claim's PV carries no node affinity.
var _ = Describe("a WaitForFirstConsumer claim", func() {
	It("binds and runs when it fits; when larger than any room, the scheduler keeps its pod off every node", func() {
		must(fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: %s}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "2"}
volumeBindingMode: WaitForFirstConsumer
`, wffcClass), "apply", "-f", "-")
		DeferCleanup(func() { _, _ = kubectl("", "delete", "storageclass", wffcClass) })

		By("the class gets one CSIStorageCapacity for the node plugin's topology segment")
		Eventually(func() []capacityObject { return capacityOf(wffcClass) }, deadline.Scale(3*time.Minute), 2*time.Second).
			Should(HaveLen(1), "the external-provisioner publishes the class's room")
		published := capacityOf(wffcClass)[0]
		publishedAt := time.Now()
		Expect(published.NodeTopology).To(Equal(map[string]string{"topology.storage.cairn.io/node-plugin": "present"}))
		fits := resource.MustParse("64Mi")
		Expect(published.MaximumVolumeSize).To(BeNumerically(">=", fits.Value()), "room for the claim that fits")
		for _, n := range strings.Split(must("", "get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name}={.metadata.labels.topology\.storage\.cairn\.io/node-plugin}{"\n"}{end}`), "\n") {
			Expect(n).To(HaveSuffix("=present"), "kubelet labels every node the node plugin registered on (all run it)")
		}

		By("a claim that fits: bound once the scheduler places its pod, and the pod runs")
		pvc("cap-fits", wffcClass, "64Mi", false, "")
		scheduledPod("cap-fits", "cap-fits")
		waitPod("cap-fits", 4*time.Minute)
		Expect(must("", "-n", "default", "get", "pvc", "cap-fits", "-o", "jsonpath={.status.phase}")).To(Equal("Bound"))
		Expect(podExec("cap-fits", "cat /data/f")).To(Equal("fits"))
		Expect(eventsOf("Pod", "cap-fits", "FailedScheduling")).NotTo(ContainSubstring("enough free storage"),
			"the class's capacity object was there before the pod")
		pv := must("", "-n", "default", "get", "pvc", "cap-fits", "-o", "jsonpath={.spec.volumeName}")
		Expect(must("", "get", "pv", pv, "-o", "jsonpath={.spec.nodeAffinity}")).To(BeEmpty(),
			"the topology segment is for capacity only: volumes attach anywhere")

		By("a claim larger than any room: the scheduler keeps its pod off every node, no Volume is made")
		over := resource.MustParse(overSize)
		Expect(over.Value()).To(BeNumerically(">", 4*largestDisk()),
			"%s must be more than any disk holds, even over-provisioned", overSize)
		Expect(over.Value()).To(BeNumerically(">", published.MaximumVolumeSize))
		pvc("cap-big", wffcClass, overSize, false, "")
		scheduledPod("cap-big", "cap-big")
		Eventually(func() string { return eventsOf("Pod", "cap-big", "FailedScheduling") }, deadline.Scale(3*time.Minute), 2*time.Second).
			Should(ContainSubstring("did not have enough free storage"), "the scheduler refuses the pod for room")
		Expect(must("", "-n", "default", "get", "pod", "cap-big", "-o", "jsonpath={.status.phase} {.spec.nodeName}")).To(Equal("Pending"))
		Expect(must("", "-n", "default", "get", "pvc", "cap-big", "-o", "jsonpath={.status.phase} {.spec.volumeName}")).To(Equal("Pending"))
		Expect(must("", "-n", "default", "get", "pvc", "cap-big", "-o", `jsonpath={.metadata.annotations.volume\.kubernetes\.io/selected-node}`)).
			To(BeEmpty(), "no node was chosen, so the provisioner is not asked")
		Expect(eventsOf("PersistentVolumeClaim", "cap-big", "ProvisioningFailed")).To(BeEmpty())
		Expect(volumesOfClaim("default/cap-big")).To(BeEmpty())

		By("the capacity object stays across the provisioner's polls")
		Consistently(func() []capacityObject { return capacityOf(wffcClass) }, max(capacityPoll+15*time.Second-time.Since(publishedAt), time.Second), 2*time.Second).
			Should(ConsistOf(HaveField("UID", published.UID)), "the object published first is neither deleted nor replaced")
		Expect(volumesOfClaim("default/cap-big")).To(BeEmpty(), "still no Volume for the claim that does not fit")
	})
})
