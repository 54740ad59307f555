//go:build e2e

// Package e2e runs Cairn on a real cluster: `make test-e2e` brings up a
// three-node kind cluster with Cairn deployed (hack/kind-up.sh) and runs
// this suite against the current kubectl context. Every spec checks data,
// not only status.
package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
)

func TestE2E(t *testing.T) {
	RegisterFailHandler(Fail)
	RunSpecs(t, "Cairn e2e")
}

const ns = "cairn-system"

// appImage runs in the test pods: it has sh, dd, sha256sum and df.
var appImage = envOr("E2E_APP_IMAGE", "kind-offline/e2e-tools:local")

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}

// kubectl runs kubectl and returns its output; stdin is fed from in.
func kubectl(in string, args ...string) (string, error) {
	cmd := exec.Command("kubectl", args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if in != "" {
		cmd.Stdin = strings.NewReader(in)
	}
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, errb.String())
	}
	return strings.TrimSpace(out.String()), nil
}

func must(in string, args ...string) string {
	GinkgoHelper()
	out, err := kubectl(in, args...)
	Expect(err).NotTo(HaveOccurred())
	return out
}

// pvc creates a claim of a StorageClass, filesystem or block.
func pvc(name, class, size string, block bool, source string) {
	GinkgoHelper()
	mode := "Filesystem"
	if block {
		mode = "Block"
	}
	y := fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: %s, namespace: default}
spec:
  storageClassName: %s
  volumeMode: %s
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: %s}}
%s`, name, class, mode, size, source)
	must(y, "apply", "-f", "-")
	DeferCleanup(func() { kubectl("", "-n", "default", "delete", "pvc", name, "--wait=true", "--timeout=3m") })
}

// pod starts a pod on node running script with claim mounted at /data
// (or, for a block claim, its device at /dev/xvda), and waits until Ready.
func pod(name, node, claim string, block bool, script string) {
	GinkgoHelper()
	vol := "volumeMounts: [{name: d, mountPath: /data}]"
	if block {
		vol = "volumeDevices: [{name: d, devicePath: /dev/xvda}]"
	}
	y := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default}
spec:
  nodeName: %s
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", %q]
    readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
    %s
  volumes:
  - {name: d, persistentVolumeClaim: {claimName: %s}}
`, name, node, appImage, script+" && touch /tmp/ready && sleep infinity", vol, claim)
	must(y, "apply", "-f", "-")
	DeferCleanup(func() { kubectl("", "-n", "default", "delete", "pod", name, "--wait=true", "--timeout=2m") })
	_, err := kubectl("", "-n", "default", "wait", "pod/"+name, "--for=condition=Ready", "--timeout=4m")
	if err != nil {
		logs, _ := kubectl("", "-n", "default", "logs", name)
		desc, _ := kubectl("", "-n", "default", "describe", "pod", name)
		Fail(fmt.Sprintf("pod %s not ready: %v\nlogs: %s\n%s", name, err, logs, desc))
	}
}

func deletePod(name string) {
	GinkgoHelper()
	must("", "-n", "default", "delete", "pod", name, "--wait=true", "--timeout=3m")
}

func podExec(name string, script string) string {
	GinkgoHelper()
	return must("", "-n", "default", "exec", name, "--", "sh", "-c", script)
}

// workers are the nodes, control plane first, as kind names them.
func nodes() []string {
	GinkgoHelper()
	out := must("", "get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")
	return strings.Fields(out)
}

func volumeOf(claim string) string {
	GinkgoHelper()
	return must("", "-n", "default", "get", "pvc", claim, "-o", "jsonpath={.spec.volumeName}")
}

func volumeField(vol, path string) string {
	out, _ := kubectl("", "-n", ns, "get", "volumes.storage.cairn.io", vol, "-o", "jsonpath="+path)
	return out
}

var _ = Describe("a filesystem volume", func() {
	It("keeps fsynced files when its pod moves to another node", func() {
		n := nodes()
		pvc("fs", "cairn", "256Mi", false, "")
		pod("fs-a", n[1], "fs", false, "cd /data && for i in 1 2 3; do dd if=/dev/urandom of=f$i bs=1M count=8 status=none; done && sync && sha256sum f1 f2 f3 > sums && sync")
		sums := podExec("fs-a", "cat /data/sums")
		Expect(strings.Count(sums, "\n")).To(Equal(2))
		vol := volumeOf("fs")
		Expect(volumeField(vol, "{.status.robustness}")).To(Equal("healthy"))
		Expect(strings.Fields(must("", "-n", ns, "get", "replicas.storage.cairn.io", "-l", "storage.cairn.io/volume="+vol,
			"-o", "jsonpath={.items[*].spec.nodeName}"))).To(ConsistOf(n), "one replica on each of the three nodes")
		deletePod("fs-a")
		pod("fs-b", n[2], "fs", false, "cd /data && sha256sum -c sums")
		Expect(podExec("fs-b", "cat /data/sums")).To(Equal(sums))
		Expect(volumeField(vol, "{.status.currentNodeName}")).To(Equal(n[2]))
	})
})

var _ = Describe("a raw block volume", func() {
	It("reads back on another node what was written with O_DIRECT", func() {
		n := nodes()
		pvc("blk", "cairn-block", "128Mi", true, "")
		pod("blk-a", n[1], "blk", true, "dd if=/dev/urandom of=/tmp/p bs=1M count=16 status=none && dd if=/tmp/p of=/dev/xvda bs=1M oflag=direct status=none && sha256sum < /tmp/p > /tmp/sum")
		sum := podExec("blk-a", "cat /tmp/sum")
		deletePod("blk-a")
		pod("blk-b", n[0], "blk", true, "true")
		Expect(podExec("blk-b", "dd if=/dev/xvda bs=1M count=16 iflag=direct status=none | sha256sum")).To(Equal(sum))
	})
})

var _ = Describe("a replica's instance manager lost", func() {
	It("leaves the volume degraded, then healthy, with its data", func() {
		n := nodes()
		pvc("im", "cairn", "256Mi", false, "")
		pod("im-a", n[1], "im", false, "cd /data && dd if=/dev/urandom of=f bs=1M count=32 status=none && sync && sha256sum f > sum && sync")
		vol := volumeOf("im")
		victim := n[2]
		imPod := must("", "-n", ns, "get", "pod", "-l", "app.kubernetes.io/component=instance-manager",
			"--field-selector", "spec.nodeName="+victim, "-o", "name")
		must("", "-n", ns, "delete", imPod, "--wait=false")
		Eventually(func() string { return volumeField(vol, "{.status.robustness}") }, 2*time.Minute, time.Second).Should(Equal("degraded"))
		podExec("im-a", "cd /data && dd if=/dev/urandom of=g bs=1M count=8 status=none && sync && sha256sum g >> sum && sync")
		Eventually(func() string { return volumeField(vol, "{.status.robustness}") }, 4*time.Minute, time.Second).Should(Equal("healthy"))
		deletePod("im-a")
		pod("im-b", n[0], "im", false, "cd /data && sha256sum -c sum")
	})
})

var _ = Describe("snapshots, clones and expansion", func() {
	It("restores the data at snapshot time, clones the current data, and grows online", func() {
		n := nodes()
		must(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: cairn-e2e-xfs}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "2", fsType: xfs}
allowVolumeExpansion: true
`, "apply", "-f", "-")
		DeferCleanup(func() { kubectl("", "delete", "storageclass", "cairn-e2e-xfs") })
		pvc("src", "cairn-e2e-xfs", "320Mi", false, "")
		pod("src-a", n[1], "src", false, "cd /data && echo before > f && sync")
		must(`apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: src-snap, namespace: default}
spec: {volumeSnapshotClassName: cairn, source: {persistentVolumeClaimName: src}}
`, "apply", "-f", "-")
		DeferCleanup(func() {
			kubectl("", "-n", "default", "delete", "volumesnapshot", "src-snap", "--wait=true", "--timeout=2m")
		})
		Eventually(func() string {
			out, _ := kubectl("", "-n", "default", "get", "volumesnapshot", "src-snap", "-o", "jsonpath={.status.readyToUse}")
			return out
		}, 2*time.Minute, time.Second).Should(Equal("true"))
		podExec("src-a", "cd /data && echo after > f && sync")
		pvc("restored", "cairn-e2e-xfs", "320Mi", false, "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: src-snap}")
		pvc("cloned", "cairn-e2e-xfs", "320Mi", false, "  dataSource: {kind: PersistentVolumeClaim, name: src}")
		pod("restored-a", n[2], "restored", false, "grep -qx before /data/f")
		pod("cloned-a", n[2], "cloned", false, "grep -qx after /data/f")

		before := podExec("src-a", "df -k /data | tail -1 | awk '{print $2}'")
		must("", "-n", "default", "patch", "pvc", "src", "-p", `{"spec":{"resources":{"requests":{"storage":"640Mi"}}}}`)
		Eventually(func() string { return podExec("src-a", "df -k /data | tail -1 | awk '{print $2}'") }, 3*time.Minute, 2*time.Second).
			ShouldNot(Equal(before), "the filesystem grew in the pod")
		Expect(podExec("src-a", "cat /data/f")).To(Equal("after"))
	})
})

// After every spec (whose cleanups deleted its claims): deleting every
// claim leaves no Volume, Engine, Replica, Snapshot or replica data on any
// node.
var _ = AfterSuite(func() {
	Eventually(func() string {
		out, _ := kubectl("", "-n", ns, "get", "volumes.storage.cairn.io,engines.storage.cairn.io,replicas.storage.cairn.io,snapshots.storage.cairn.io", "-o", "name")
		return out
	}, 4*time.Minute, 2*time.Second).Should(BeEmpty())
	for _, node := range nodes() {
		Eventually(func() string {
			out, _ := exec.Command("docker", "exec", node, "ls", "-A", "/var/lib/cairn/replicas").CombinedOutput()
			return strings.TrimSpace(string(out))
		}, time.Minute, 2*time.Second).Should(BeEmpty(), "no replica data on %s", node)
	}
})
