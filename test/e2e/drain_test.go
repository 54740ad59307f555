//go:build e2e

package e2e

import (
	"fmt"
	"os/exec"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// drainAsync runs `kubectl drain node` in the background (it waits while
// something holds the drain) and returns a channel that gets its error
// and output when it ends. The node is uncordoned when the spec ends.
func drainAsync(node string) <-chan error {
	DeferCleanup(func() { cleanup("uncordon", node) })
	done := make(chan error, 1)
	go func() {
		defer GinkgoRecover()
		out, err := exec.Command("kubectl", "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", timeoutFlag(12*time.Minute)).CombinedOutput()
		GinkgoWriter.Printf("kubectl drain %s: %s\n", node, out)
		if err != nil {
			err = fmt.Errorf("kubectl drain %s: %w: %s", node, err, out)
		}
		done <- err
	}()
	return done
}

// setSchedulable sets spec.allowScheduling of node's StorageNode.
func setSchedulable(node string, on bool) {
	GinkgoHelper()
	must("", "-n", ns, "patch", "storagenodes.storage.cairn.io", node, "--type", "merge", "-p", fmt.Sprintf(`{"spec":{"allowScheduling":%v}}`, on))
}

// replicaNodes lists the nodes that hold a replica of vol.
func replicaNodes(vol string) []string {
	out, _ := kubectl("", "-n", ns, "get", "replicas.storage.cairn.io", "-l", "storage.cairn.io/volume="+vol, "-o", "jsonpath={.items[*].spec.nodeName}")
	return strings.Fields(out)
}

// verifyOrWrite is an app that, on a volume without data, writes 16 MiB
// with fsync and its checksum; on one with data, checks it. /tmp/verified
// says "first", "ok" or "bad".
const verifyOrWrite = `cd /data && if [ -f sum ]; then if sha256sum -c sum >/tmp/verify 2>&1; then echo ok > /tmp/verified; else echo bad > /tmp/verified; fi; ` +
	`else dd if=/dev/urandom of=f bs=1M count=16 conv=fsync status=none && sha256sum f > sum && sync && echo first > /tmp/verified; fi`

var _ = Describe("a node drained", func() {
	It("holds the drain of the node with a volume's last healthy replica until it is moved, and the app comes back elsewhere with its data", func() {
		n := nodes()
		workers := []string{}
		for _, x := range n {
			if !strings.HasSuffix(x, "control-plane") {
				workers = append(workers, x)
			}
		}
		Expect(len(workers)).To(BeNumerically(">=", 2))
		target := workers[0]
		// One replica, placed on the node to drain: the others take none
		// while the claim is provisioned.
		must(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: cairn-e2e-1r}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "1", fsType: ext4}
reclaimPolicy: Delete
volumeBindingMode: Immediate
`, "apply", "-f", "-")
		DeferCleanup(func() { cleanup("delete", "storageclass", "cairn-e2e-1r") })
		for _, x := range n {
			if x != target {
				setSchedulable(x, false)
				DeferCleanup(setSchedulable, x, true)
			}
		}
		pvc("dr-app", "cairn-e2e-1r", "128Mi", false, "")
		vol := volumeOf("dr-app")
		Eventually(func() []string { return replicaNodes(vol) }, deadline.Scale(2*time.Minute), time.Second).Should(Equal([]string{target}))
		for _, x := range n {
			if x != target {
				setSchedulable(x, true)
			}
		}
		// The app, a Deployment (a drain evicts only pods a controller
		// brings back), on the same node.
		must(fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: dr-app, namespace: default}
spec:
  replicas: 1
  strategy: {type: Recreate}
  selector: {matchLabels: {app: dr-app}}
  template:
    metadata: {labels: {app: dr-app}}
    spec:
      terminationGracePeriodSeconds: 1
      affinity: {nodeAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 100, preference: {matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [%s]}]}}]}}
      containers:
      - name: app
        image: %s
        imagePullPolicy: IfNotPresent
        command: ["sh", "-c", %q]
        readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
        volumeMounts: [{name: d, mountPath: /data}]
      volumes:
      - {name: d, persistentVolumeClaim: {claimName: dr-app}}
`, target, appImage, verifyOrWrite+" && touch /tmp/ready && sleep infinity"), "apply", "-f", "-")
		DeferCleanup(func() { cleanup("-n", "default", "delete", "deployment", "dr-app", "--wait=true", "--timeout=2m") })
		appPod := func() (string, string) {
			out, _ := kubectl("", "-n", "default", "get", "pod", "-l", "app=dr-app", "-o",
				`jsonpath={range .items[?(@.status.phase=="Running")]}{.metadata.name} {.spec.nodeName}{"\n"}{end}`)
			f := strings.Fields(out)
			if len(f) != 2 {
				return "", ""
			}
			return f[0], f[1]
		}
		Eventually(func() string { _, node := appPod(); return node }, deadline.Scale(4*time.Minute), time.Second).Should(Equal(target))
		first, _ := appPod()
		Eventually(func() string { return podExec(first, "cat /tmp/verified 2>/dev/null; true") }, deadline.Scale(2*time.Minute), time.Second).Should(Equal("first"))
		Eventually(robustness(vol), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"))

		done := drainAsync(target)
		// The drain evicts the app; it starts on another node and attaches
		// the volume there, whose only healthy replica is still on the
		// drained node: the drain waits until a replacement is rebuilt.
		Eventually(func() string {
			name, node := appPod()
			if name == "" || name == first || node == target {
				return ""
			}
			return podExec(name, "cat /tmp/verified 2>/dev/null; true")
		}, deadline.Scale(8*time.Minute), 2*time.Second).Should(Equal("ok"), "the app, evicted, reads its data back on another node")
		var err error
		Eventually(done, deadline.Scale(12*time.Minute), time.Second).Should(Receive(&err))
		Expect(err).NotTo(HaveOccurred())
		Expect(replicaNodes(vol)).NotTo(ContainElement(target), "the drain ended while the volume's only healthy replica was still on %s", target)
		Eventually(robustness(vol), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"))
		events := must("", "-n", ns, "get", "events", "--field-selector", "involvedObject.name="+vol, "-o", "jsonpath={.items[*].reason}")
		Expect(events).To(ContainSubstring("ReplicaMoved"))
	})

	It("lets a replica-only node go at once, and the app on another node sees no error", func() {
		n := nodes()
		var app, target string
		for _, x := range n {
			if strings.HasSuffix(x, "control-plane") {
				app = x
			} else if target == "" {
				target = x
			}
		}
		pvc("dr-rep", "cairn", "128Mi", false, "")
		startPod("dr-rep", app, "dr-rep", false, appImage, recordWriter)
		waitPod("dr-rep", 4*time.Minute)
		vol := volumeOf("dr-rep")
		Expect(replicaNodes(vol)).To(ContainElement(target))
		Eventually(robustness(vol), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"))
		Eventually(func() int { return writerState("dr-rep", "acked") }, deadline.Scale(time.Minute), time.Second).Should(BeNumerically(">=", 10))
		before := writerState("dr-rep", "acked")
		done := drainAsync(target)
		var err error
		Eventually(done, deadline.Scale(5*time.Minute), time.Second).Should(Receive(&err), "a node whose replicas all have healthy copies elsewhere is not held")
		Expect(err).NotTo(HaveOccurred())
		Eventually(func() int { return writerState("dr-rep", "acked") }, deadline.Scale(time.Minute), time.Second).Should(BeNumerically(">", before+10))
		Expect(writerState("dr-rep", "errors")).To(Equal(0))
		checkRecords("dr-rep")
	})
})
