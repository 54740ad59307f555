//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"sigs.k8s.io/yaml"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// bundleClass is the encrypted StorageClass of the support bundle spec;
// bundleSecret, in Cairn's namespace, holds its passphrase.
const (
	bundleClass  = "cairn-e2e-bundle"
	bundleSecret = "cairn-e2e-bundle"
)

// cairnPod is what the spec needs of a pod of Cairn's namespace.
type cairnPod struct {
	Metadata struct {
		Name   string            `json:"name"`
		UID    string            `json:"uid"`
		Labels map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		NodeName       string `json:"nodeName"`
		InitContainers []struct {
			Name string `json:"name"`
		} `json:"initContainers"`
		Containers []struct {
			Name string `json:"name"`
		} `json:"containers"`
	} `json:"spec"`
	Status struct {
		InitContainerStatuses []containerStatus `json:"initContainerStatuses"`
		ContainerStatuses     []containerStatus `json:"containerStatuses"`
	} `json:"status"`
}

type containerStatus struct {
	Name         string `json:"name"`
	RestartCount int    `json:"restartCount"`
}

func (p cairnPod) containers() []string {
	var out []string
	for _, c := range p.Spec.InitContainers {
		out = append(out, c.Name)
	}
	for _, c := range p.Spec.Containers {
		out = append(out, c.Name)
	}
	return out
}

func (p cairnPod) restarts(container string) int {
	for _, st := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if st.Name == container {
			return st.RestartCount
		}
	}
	return 0
}

// cairnPods are the pods of Cairn's namespace, by name.
func cairnPods() map[string]cairnPod {
	GinkgoHelper()
	var list struct {
		Items []cairnPod `json:"items"`
	}
	Expect(json.Unmarshal([]byte(must("", "-n", ns, "get", "pods", "-o", "json")), &list)).To(Succeed())
	out := map[string]cairnPod{}
	for _, p := range list.Items {
		out[p.Metadata.Name] = p
	}
	return out
}

// imProcesses are "name kind state" of each process the node's
// InstanceManager status lists.
func imProcesses(node string) []string {
	out, _ := kubectl("", "-n", ns, "get", "instancemanagers.storage.cairn.io", "im-"+node,
		"-o", `jsonpath={range .status.processes[*]}{.name} {.kind} {.state}{"\n"}{end}`)
	return strings.Split(out, "\n")
}

// buildPlugin builds cmd/kubectl-cairn from this tree into dir, so the
// spec runs the plugin of the commit under test, not an older bin/.
func buildPlugin(dir string) string {
	GinkgoHelper()
	bin := filepath.Join(dir, "kubectl-cairn")
	ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(10*time.Minute))
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "../../cmd/kubectl-cairn").CombinedOutput()
	Expect(err).NotTo(HaveOccurred(), "go build ./cmd/kubectl-cairn: %s", out)
	return bin
}

// readArchive returns the files of a tar.gz by name, and the whole tar
// stream unpacked (names and contents).
func readArchive(file string) (map[string][]byte, []byte) {
	GinkgoHelper()
	out, err := os.ReadFile(file)
	Expect(err).NotTo(HaveOccurred())
	gz, err := gzip.NewReader(bytes.NewReader(out))
	Expect(err).NotTo(HaveOccurred())
	raw, err := io.ReadAll(gz)
	Expect(err).NotTo(HaveOccurred())
	files := map[string][]byte{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		Expect(err).NotTo(HaveOccurred())
		data, err := io.ReadAll(tr)
		Expect(err).NotTo(HaveOccurred())
		Expect(h.Name).To(HavePrefix("cairn-support/"))
		files[strings.TrimPrefix(h.Name, "cairn-support/")] = data
	}
	return files, raw
}

// objectNames are the metadata.name of the objects of a YAML list the
// bundle wrote.
func objectNames(data []byte) []string {
	GinkgoHelper()
	var items []struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	Expect(yaml.Unmarshal(data, &items)).To(Succeed())
	var out []string
	for _, it := range items {
		out = append(out, it.Metadata.Name)
	}
	return out
}

// logIndexRow is a row of logs/containers.txt.
type logIndexRow struct {
	pod, node, container string
	restarts             int
	current, previous    string
}

func logIndex(data []byte) map[string]logIndexRow {
	GinkgoHelper()
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	Expect(lines).NotTo(BeEmpty())
	Expect(strings.Fields(lines[0])).To(Equal([]string{"POD", "NODE", "CONTAINER", "RESTARTS", "CURRENT", "PREVIOUS"}))
	out := map[string]logIndexRow{}
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		Expect(len(f)).To(BeNumerically(">=", 6), "row %q", l)
		n, err := strconv.Atoi(f[3])
		Expect(err).NotTo(HaveOccurred(), "row %q", l)
		// CURRENT is one word (a file); PREVIOUS may be a sentence.
		out[f[0]+"/"+f[2]] = logIndexRow{pod: f[0], node: f[1], container: f[2], restarts: n, current: f[4], previous: strings.Join(f[5:], " ")}
	}
	return out
}

// restartedPod is the spec's own pod in Cairn's namespace whose container
// restarted once.
const restartedPod = "cairn-e2e-bundle-restarted"

// The drain guard waits for its termination and writes nothing: its log
// is collected but may be empty.
var silentComponents = map[string]bool{"drain-guard": true}

var _ = Describe("the support bundle against the kind cluster", func() {
	It("holds every Cairn pod's logs, each node's processes, mounts, loop devices and disk usage, the claim's objects and versions, and no Secret", func() {
		n := nodes()
		attached := n[1]
		key := make([]byte, 24)
		_, err := rand.Read(key)
		Expect(err).NotTo(HaveOccurred())
		secret := "cairn-e2e-bundle-" + hex.EncodeToString(key)

		// The claim is encrypted with the Secret's value as its
		// passphrase, so the value passes through the provisioner, the
		// manager (which keeps it in the volume's key Secret), the attach
		// and the engine on the node: any of them logging it would put it
		// in the bundle.
		must("", "-n", ns, "create", "secret", "generic", bundleSecret, "--from-literal=passphrase="+secret)
		must(fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: %[1]s}
provisioner: storage.cairn.io
parameters:
  numberOfReplicas: "3"
  encrypted: "true"
  csi.storage.k8s.io/provisioner-secret-name: %[2]s
  csi.storage.k8s.io/provisioner-secret-namespace: %[3]s
  csi.storage.k8s.io/controller-publish-secret-name: %[2]s
  csi.storage.k8s.io/controller-publish-secret-namespace: %[3]s
`, bundleClass, bundleSecret, ns), "apply", "-f", "-")
		var pv string
		// The attacher detaches and the provisioner deletes the PV with
		// the class's Secret: both go once the PV has (cleanups run last
		// registered first, after the pod's and the claim's).
		DeferCleanup(func() {
			if pv != "" {
				Eventually(func() string {
					out, _ := kubectl("", "get", "pv", pv, "--ignore-not-found", "-o", "name")
					return out
				}, deadline.Scale(4*time.Minute), 2*time.Second).Should(BeEmpty(), "PV %s deleted", pv)
			}
			_, _ = kubectl("", "delete", "storageclass", bundleClass, "--ignore-not-found")
			_, _ = kubectl("", "-n", ns, "delete", "secret", bundleSecret, "--ignore-not-found", timeoutFlag(3*time.Minute))
		})
		pvc("bundle", bundleClass, "64Mi", false, "")
		pod("bundle-a", attached, "bundle", false, "head -c 4194304 /dev/urandom > /data/f && sync")
		vol := volumeOf("bundle")
		pv = vol
		Expect(volumeField(vol, "{.spec.encryption.keyCheck}")).NotTo(BeEmpty(), "the volume is encrypted")
		Eventually(robustness(vol), deadline.Scale(4*time.Minute), time.Second).Should(Equal("healthy"))
		Expect(volumeField(vol, "{.status.currentNodeName}")).To(Equal(attached))
		podUID := must("", "-n", "default", "get", "pod", "bundle-a", "-o", "jsonpath={.metadata.uid}")

		// Each node holds one replica; its data directory is what du and
		// the replica's command line name.
		replicaDir := map[string]string{} // node -> replica's data directory name
		replicaName := map[string]string{}
		for _, l := range strings.Split(must("", "-n", ns, "get", "replicas.storage.cairn.io", "-l", "storage.cairn.io/volume="+vol,
			"-o", `jsonpath={range .items[*]}{.spec.nodeName} {.metadata.name} {.spec.dataDirectoryName}{"\n"}{end}`), "\n") {
			f := strings.Fields(l)
			Expect(f).To(HaveLen(3), "replica line %q", l)
			replicaName[f[0]], replicaDir[f[0]] = f[1], f[2]
		}
		Expect(replicaName).To(HaveLen(len(n)), "one replica on each node: %v", replicaName)
		// What the bundle reports from the InstanceManagers' status, as
		// they report it once the processes run.
		engineProc := ns + "/" + vol + "-e"
		for _, node := range n {
			want := []string{ns + "/" + replicaName[node] + " replica running"}
			if node == attached {
				want = append(want, engineProc+" engine running")
			}
			Eventually(func() []string { return imProcesses(node) }, deadline.Scale(2*time.Minute), time.Second).
				Should(ContainElements(want), "the instance manager on %s reports the volume's processes", node)
		}

		// A pod of the namespace whose container ran once, exited and
		// runs again (an emptyDir outlives a container's restart): the
		// bundle must hold its previous run's log beside the current one.
		// On the control plane, which no spec stops or drains.
		must(fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %[1]s, namespace: %[2]s, labels: {app.kubernetes.io/name: cairn-e2e}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %[4]s
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "if [ -f /run/x/ran ]; then echo second run; exec sleep infinity; fi; touch /run/x/ran; echo first run; exit 1"]
    volumeMounts: [{name: x, mountPath: /run/x}]
  volumes:
  - {name: x, emptyDir: {}}
`, restartedPod, ns, n[0], appImage), "apply", "-f", "-")
		DeferCleanup(func() {
			_, _ = kubectl("", "-n", ns, "delete", "pod", restartedPod, "--ignore-not-found", timeoutFlag(2*time.Minute))
		})
		Eventually(func() string {
			out, _ := kubectl("", "-n", ns, "get", "pod", restartedPod, "-o", `jsonpath={.status.containerStatuses[0].restartCount} {.status.containerStatuses[0].ready}`)
			return out
		}, deadline.Scale(3*time.Minute), time.Second).Should(Equal("1 true"), "pod %s restarted once and runs", restartedPod)

		before := cairnPods()
		dir := GinkgoT().TempDir()
		bin := buildPlugin(dir)
		file := filepath.Join(dir, "bundle.tar.gz")
		ctx, cancel := context.WithTimeout(context.Background(), deadline.Scale(5*time.Minute))
		defer cancel()
		// The plugin reads the same kubeconfig and current context as
		// kubectl() ($KUBECONFIG or ~/.kube/config).
		cmd := exec.CommandContext(ctx, bin, "support-bundle", file)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		Expect(cmd.Run()).To(Succeed(), "kubectl cairn support-bundle: %s", stderr.String())
		GinkgoWriter.Printf("the plugin's stderr:\n%s", stderr.String())
		Expect(strings.TrimSpace(stdout.String())).To(Equal(file))
		after := cairnPods()
		files, raw := readArchive(file)
		GinkgoWriter.Printf("NOTES.txt:\n%s\n", files["NOTES.txt"])
		file1 := func(name string) string {
			GinkgoHelper()
			data, ok := files[name]
			Expect(ok).To(BeTrue(), "%s in the bundle", name)
			return string(data)
		}

		By("no Secret's value, raw or base64, anywhere in the archive or the output")
		for _, s := range []string{secret, base64.StdEncoding.EncodeToString([]byte(secret))} {
			Expect(bytes.Contains(raw, []byte(s))).To(BeFalse(), "the known Secret value %q is in the archive", s)
			for name, data := range files {
				Expect(bytes.Contains(data, []byte(s))).To(BeFalse(), "the known Secret value is in %s", name)
			}
			Expect(stdout.String() + stderr.String()).NotTo(ContainSubstring(s))
		}

		By("every Cairn pod's current log, and its previous one if it restarted")
		index := logIndex([]byte(file1("logs/containers.txt")))
		lived := 0
		for name, p := range before {
			if a, ok := after[name]; !ok || a.Metadata.UID != p.Metadata.UID {
				continue // deleted while the bundle was written (other work on the cluster)
			}
			lived++
			for _, c := range p.containers() {
				row, ok := index[name+"/"+c]
				Expect(ok).To(BeTrue(), "logs/containers.txt has %s/%s:\n%s", name, c, file1("logs/containers.txt"))
				Expect(row.node).To(Equal(p.Spec.NodeName), "%s/%s", name, c)
				Expect(row.current).To(Equal("logs/"+name+"/"+c+".log"), "%s/%s", name, c)
				current := file1(row.current)
				if !silentComponents[p.Metadata.Labels["app.kubernetes.io/component"]] {
					Expect(current).NotTo(BeEmpty(), "the log of %s/%s", name, c)
				}
				Expect(row.restarts).To(And(BeNumerically(">=", p.restarts(c)), BeNumerically("<=", after[name].restarts(c))),
					"%s/%s: the restart count the bundle saw", name, c)
				if row.restarts == 0 {
					Expect(row.previous).To(Equal("none: not restarted"), "%s/%s", name, c)
					Expect(files).NotTo(HaveKey("logs/"+name+"/"+c+".previous.log"), "%s/%s never restarted", name, c)
				} else {
					Expect(row.previous).To(Equal("logs/"+name+"/"+c+".previous.log"), "%s/%s restarted %d times", name, c, row.restarts)
					file1(row.previous)
				}
			}
		}
		Expect(before).To(HaveKey(restartedPod))
		Expect(index).To(HaveKeyWithValue(restartedPod+"/app", logIndexRow{pod: restartedPod, node: n[0], container: "app", restarts: 1,
			current: "logs/" + restartedPod + "/app.log", previous: "logs/" + restartedPod + "/app.previous.log"}))
		Expect(file1("logs/" + restartedPod + "/app.log")).To(Equal("second run\n"))
		Expect(file1("logs/" + restartedPod + "/app.previous.log")).To(Equal("first run\n"))
		Expect(lived).To(BeNumerically(">=", 1+2*len(n)), "the manager, and each node's instance manager and node plugin, outlived the bundle")
		for _, component := range []string{"manager", "csi-controller", "csi-node", "instance-manager"} {
			found := false
			for _, p := range before {
				found = found || p.Metadata.Labels["app.kubernetes.io/component"] == component
			}
			Expect(found).To(BeTrue(), "a %s pod runs in %s", component, ns)
		}
		// What could not be collected is a note; none may be about a pod
		// that lived through the whole bundle.
		for name := range before {
			if _, ok := after[name]; ok {
				Expect(file1("NOTES.txt")).NotTo(ContainSubstring(name), "a part of %s was not collected", name)
			}
		}

		By("each node: the instance manager's processes, mounts, loop devices and disk usage")
		for _, node := range n {
			status := file1("processes/" + node + "_im-" + node + ".txt")
			Expect(status).To(MatchRegexp(`(?m)^`+regexp.QuoteMeta(ns+"/"+replicaName[node])+`\s+replica\s+running\s`), "node %s:\n%s", node, status)
			procs := file1("nodes/" + node + "/processes.txt")
			Expect(procs).To(MatchRegexp(`(?m)^1 0 \d+ /cairn-data instance-manager `), "node %s:\n%s", node, procs)
			Expect(procs).To(MatchRegexp(`(?m)^\d+ 1 \d+ /cairn-data replica --dir \S*`+regexp.QuoteMeta(replicaDir[node])+` `), "node %s:\n%s", node, procs)
			if node == attached {
				Expect(status).To(MatchRegexp(`(?m)^`+regexp.QuoteMeta(engineProc)+`\s+engine\s+running\s`), "node %s:\n%s", node, status)
				Expect(procs).To(MatchRegexp(`(?m)^\d+ 1 \d+ /cairn-data engine --name `+regexp.QuoteMeta(vol)+` `), "node %s:\n%s", node, procs)
			} else {
				Expect(procs).NotTo(ContainSubstring("engine --name "+vol), "node %s runs no engine of %s", node, vol)
			}

			mounts := file1("nodes/" + node + "/mounts.txt")
			Expect(mounts).To(MatchRegexp(`(?m)^\d+ \d+ \d+:\d+ \S+ /var/lib/kubelet `), "node %s: the node plugin's mountinfo", node)
			devices := file1("nodes/" + node + "/block-devices.txt")
			Expect(devices).To(MatchRegexp(`(?m)^NAME\s+MAJ:MIN`), "node %s: lsblk ran", node)
			if node == attached {
				Expect(mounts).To(ContainSubstring("/var/lib/kubelet/pods/"+podUID+"/volumes/kubernetes.io~csi/"+vol+"/mount"), "node %s: the pod's mount of the claim", node)
				Expect(mounts).To(MatchRegexp(`/var/lib/kubelet/plugins/kubernetes.io/csi/storage.cairn.io/[0-9a-f]+/globalmount `), "node %s: the staged volume", node)
				Expect(devices).To(MatchRegexp(`(?m)^/dev/loop\d+ .*`+regexp.QuoteMeta(vol)), "node %s: the claim's loop device:\n%s", node, devices)
			} else {
				Expect(mounts).NotTo(ContainSubstring("/"+vol+"/mount"), "node %s does not mount %s", node, vol)
			}

			usage := file1("nodes/" + node + "/disk-usage.txt")
			Expect(usage).To(MatchRegexp(`(?m)^Filesystem\s+Size\s+Used\s+Avail`), "node %s:\n%s", node, usage)
			Expect(usage).To(MatchRegexp(`(?m)\s/var/lib/cairn/replicas$`), "node %s: df of the replicas' disk:\n%s", node, usage)
			Expect(usage).To(MatchRegexp(`(?m)^\S+\s+/var/lib/cairn/replicas/`+regexp.QuoteMeta(replicaDir[node])+`$`), "node %s: du of the replica:\n%s", node, usage)
		}

		By("the claim's objects")
		Expect(objectNames(files["objects/volumes.yaml"])).To(ContainElement(vol))
		Expect(objectNames(files["objects/engines.yaml"])).To(ContainElement(vol + "-e"))
		var replicas []any
		for _, r := range replicaName {
			replicas = append(replicas, r)
		}
		Expect(objectNames(files["objects/replicas.yaml"])).To(ContainElements(replicas...))
		Expect(objectNames(files["objects/persistentvolumes.yaml"])).To(ContainElement(vol))
		Expect(objectNames(files["objects/persistentvolumeclaims.yaml"])).To(ContainElement("bundle"))
		Expect(objectNames(files["objects/storageclasses.yaml"])).To(ContainElement(bundleClass))
		Expect(file1("objects/volumeattachments.yaml")).To(ContainSubstring("persistentVolumeName: " + vol))
		Expect(objectNames(files["objects/instancemanagers.yaml"])).To(ContainElements("im-"+n[0], "im-"+n[1], "im-"+n[2]))

		By("the versions")
		var versions struct {
			Kubernetes       string              `json:"kubernetes"`
			InstanceManagers map[string]string   `json:"instanceManagers"`
			PodImages        map[string][]string `json:"podImages"`
			Plugin           map[string]string   `json:"kubectl-cairn"`
		}
		Expect(yaml.Unmarshal([]byte(file1("versions.yaml")), &versions)).To(Succeed())
		var server struct {
			ServerVersion struct {
				GitVersion string `json:"gitVersion"`
			} `json:"serverVersion"`
		}
		Expect(json.Unmarshal([]byte(must("", "version", "-o", "json")), &server)).To(Succeed())
		Expect(versions.Kubernetes).To(Equal(server.ServerVersion.GitVersion))
		Expect(versions.Plugin).To(HaveKeyWithValue("go", HavePrefix("go")))
		for _, node := range n {
			v := must("", "-n", ns, "get", "instancemanagers.storage.cairn.io", "im-"+node, "-o", "jsonpath={.status.version}")
			Expect(v).NotTo(BeEmpty())
			Expect(versions.InstanceManagers).To(HaveKeyWithValue("im-"+node, HavePrefix(fmt.Sprintf("node %s, version %s, image ", node, v))))
		}
		for name, p := range before {
			if _, ok := after[name]; ok {
				Expect(versions.PodImages).To(HaveKey(name))
				Expect(versions.PodImages[name]).To(HaveLen(len(p.containers())), "an image for each container of %s", name)
			}
		}
	})
})
