package main

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// benchClasses are the one-replica StorageClasses the benchmark adds
// beside the default three-replica ones (cairn, cairn-block).
const benchClasses = `apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: cairn-bench-1}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "1", fsType: ext4}
reclaimPolicy: Delete
volumeBindingMode: Immediate
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: cairn-bench-1-block}
provisioner: storage.cairn.io
parameters: {numberOfReplicas: "1"}
reclaimPolicy: Delete
volumeBindingMode: Immediate
`

// setup creates the namespace, the classes, a claim and a pod per target
// on the node, and writes each target's file once so reads hit data.
func setup(targets []target) {
	must(fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata: {name: %s}\n", ns), "apply", "-f", "-")
	must(benchClasses, "apply", "-f", "-")
	for _, t := range targets {
		if t.host {
			startHostEngine()
			continue
		}
		if t.class != "" {
			must(claimYAML("bench-"+t.name, t.class, *claimSize, t.block), "apply", "-f", "-")
		}
		must(podYAML(t), "apply", "-f", "-")
	}
	for _, t := range targets {
		if t.host {
			continue
		}
		must("", "-n", ns, "wait", "pod/"+t.pod(), "--for=condition=Ready", "--timeout=5m")
		must("", "-n", ns, "exec", t.pod(), "--", "sh", "-c",
			fmt.Sprintf("fio --name=fill --filename=%s --size=%s --rw=write --bs=1M --iodepth=4 --direct=1 --ioengine=libaio --end_fsync=1 >/dev/null", t.path(), *fileSize))
	}
}

func claimYAML(name, class, size string, block bool) string {
	mode := "Filesystem"
	if block {
		mode = "Block"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: %s, namespace: %s}
spec:
  storageClassName: %s
  volumeMode: %s
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: %s}}
`, name, ns, class, mode, size)
}

// podYAML is the target's pod on the node: fio's image, idle until the
// benchmark execs its jobs.
func podYAML(t target) string {
	mount := "volumeMounts: [{name: d, mountPath: /data}]"
	if t.block {
		mount = "volumeDevices: [{name: d, devicePath: /dev/xvda}]"
	}
	vol := fmt.Sprintf("persistentVolumeClaim: {claimName: bench-%s}", t.name)
	if t.class == "" {
		vol = "hostPath: {path: /var/lib/cairn-bench, type: DirectoryOrCreate}"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s}
spec:
  nodeName: %s
  terminationGracePeriodSeconds: 1
  containers:
  - name: fio
    image: %s
    imagePullPolicy: IfNotPresent
    command: ["sleep", "infinity"]
    %s
  volumes:
  - name: d
    %s
`, t.pod(), ns, *node, *image, mount, vol)
}

// placement names the nodes of the target's volume's engine and replicas.
func placement(t target) string {
	pv := must("", "-n", ns, "get", "pvc", "bench-"+t.name, "-o", "jsonpath={.spec.volumeName}")
	reps := must("", "-n", "cairn-system", "get", "replicas", "-l", "storage.cairn.io/volume="+pv,
		"-o", `jsonpath={range .items[*]}{.spec.nodeName} {end}`)
	return fmt.Sprintf("volume %s, replicas on [%s], engine on %s", pv, strings.TrimSpace(reps), *node)
}

func teardown() {
	if _, err := kubectl("", "delete", "namespace", ns, "--wait=true", "--timeout=5m"); err != nil {
		fmt.Printf("teardown: %v\n", err)
	}
	if _, err := kubectl("", "delete", "storageclass", "cairn-bench-1", "cairn-bench-1-block", "--ignore-not-found"); err != nil {
		fmt.Printf("teardown: %v\n", err)
	}
}

// provisioning creates n claims of the default class and a pod for each
// at once, and reports the time from a claim's creation to its pod
// Running: the median and the slowest.
func provisioning(n int) {
	var docs, names []string
	for i := range n {
		name := fmt.Sprintf("prov-%d-%02d", n, i)
		names = append(names, name)
		docs = append(docs, claimYAML(name, "cairn", "64Mi", false), provPodYAML(name, n))
	}
	start := time.Now()
	must(strings.Join(docs, "---\n"), "apply", "-f", "-")
	times := waitRunning(n, start)
	fmt.Printf("\nPVC created -> pod Running, %d at once: median %.1f s, slowest %.1f s\n", n, median(times), slices.Max(times))
	must("", "-n", ns, "delete", "pod", "-l", fmt.Sprintf("bench-provision=%d", n), "--wait=true", "--timeout=5m")
	must("", append([]string{"-n", ns, "delete", "pvc", "--wait=true", "--timeout=5m"}, names...)...)
}

func provPodYAML(name string, n int) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s, labels: {bench-provision: "%d"}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: IfNotPresent
    command: ["sleep", "infinity"]
    volumeMounts: [{name: d, mountPath: /data}]
  volumes:
  - {name: d, persistentVolumeClaim: {claimName: %s}}
`, name, ns, n, *image, name)
}

// waitRunning polls until n provisioning pods run (at most 10 minutes) and
// returns, for each, the seconds from start until it was first seen
// Running (polled every second).
func waitRunning(n int, start time.Time) []float64 {
	seen := map[string]float64{}
	deadline := start.Add(10 * time.Minute)
	for len(seen) < n {
		if time.Now().After(deadline) {
			fail("only %d of %d provisioning pods ran within 10 minutes", len(seen), n)
		}
		out := must("", "-n", ns, "get", "pods", "-l", fmt.Sprintf("bench-provision=%d", n),
			"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.phase}{"\n"}{end}`)
		now := time.Since(start).Seconds()
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) == 2 && f[1] == "Running" {
				if _, ok := seen[f[0]]; !ok {
					seen[f[0]] = now
				}
			}
		}
		time.Sleep(time.Second) // the poll interval
	}
	var out []float64
	for _, v := range seen {
		out = append(out, v)
	}
	return out
}
