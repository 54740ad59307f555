//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// images are the three images `make deploy` takes.
type images struct{ manager, data, csi string }

// deployedImages reads the images Cairn runs now from its workloads'
// templates.
func deployedImages() images {
	GinkgoHelper()
	get := func(kind, name, container string) string {
		return must("", "-n", ns, "get", kind, name, "-o", fmt.Sprintf(`jsonpath={.spec.template.spec.containers[?(@.name=="%s")].image}`, container))
	}
	im := images{manager: get("deployment", "cairn-manager", "manager"), data: get("daemonset", "cairn-instance-manager", "instance-manager"),
		csi: get("daemonset", "cairn-csi-node", "csi")}
	Expect(get("daemonset", "cairn-csi-node", "device-keeper")).To(Equal(im.data), "the device keeper runs the data-plane image")
	return im
}

// withTag is img with its tag replaced.
func withTag(img, tag string) string {
	if i := strings.LastIndex(img, ":"); i > strings.LastIndex(img, "/") {
		img = img[:i]
	}
	return img + ":" + tag
}

// kindCluster is the kind cluster under test: $CLUSTER (hack/test-e2e.sh
// exports it), else the current context's kind-NAME.
func kindCluster() string {
	GinkgoHelper()
	if c := os.Getenv("CLUSTER"); c != "" {
		return c
	}
	ctx := must("", "config", "current-context")
	Expect(ctx).To(HavePrefix("kind-"), "the e2e suite runs on a kind cluster")
	return strings.TrimPrefix(ctx, "kind-")
}

// retagAndLoad tags each image of from as the matching one of to (the
// same build under another name: a new image reference for every
// component, so everything rolls) and loads them into the kind nodes.
func retagAndLoad(from, to images) {
	GinkgoHelper()
	for _, p := range [][2]string{{from.manager, to.manager}, {from.data, to.data}, {from.csi, to.csi}} {
		docker("tag", p[0], p[1])
	}
	out, err := exec.Command("kind", "load", "docker-image", "--name", kindCluster(), to.manager, to.data, to.csi).CombinedOutput()
	Expect(err).NotTo(HaveOccurred(), "kind load: %s", out)
}

// makeDeploy runs `make deploy` of the tree with the images, which
// returns once every component has rolled out (hack/deploy.sh), and then
// gives the manager the suite's settings again (BeforeSuite), which the
// deploy's apply of the manager's arguments took away.
func makeDeploy(im images) {
	GinkgoHelper()
	root, err := filepath.Abs("../..")
	Expect(err).NotTo(HaveOccurred())
	cmd := exec.Command("make", "-C", root, "-s", "deploy", "IMG="+im.manager, "DATA_IMG="+im.data, "CSI_IMG="+im.csi)
	cmd.Env = append(os.Environ(), "ROLLOUT_TIMEOUT=20m")
	cmd.Stdout, cmd.Stderr = GinkgoWriter, GinkgoWriter
	start := time.Now()
	Expect(cmd.Run()).To(Succeed(), "make deploy IMG=%s DATA_IMG=%s CSI_IMG=%s", im.manager, im.data, im.csi)
	GinkgoWriter.Printf("make deploy of %s, %s, %s: every component rolled out in %s\n", im.manager, im.data, im.csi, time.Since(start).Round(time.Second))
	if args := must("", "-n", ns, "get", "deployment", "cairn-manager", "-o", "jsonpath={.spec.template.spec.containers[0].args}"); !strings.Contains(args, "--replenishment-wait") {
		must("", "-n", ns, "patch", "deployment", "cairn-manager", "--type=json",
			"-p", `[{"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--replenishment-wait=3m"}]`)
		must("", "-n", ns, "rollout", "status", "deployment", "cairn-manager", timeoutFlag(3*time.Minute))
	}
}

// podInfo is what the checks read of a Cairn pod.
type podInfo struct {
	Metadata struct {
		Name              string    `json:"name"`
		CreationTimestamp time.Time `json:"creationTimestamp"`
	} `json:"metadata"`
	Spec struct {
		NodeName   string `json:"nodeName"`
		Containers []struct {
			Name  string `json:"name"`
			Image string `json:"image"`
		} `json:"containers"`
	} `json:"spec"`
	Status struct {
		Conditions []struct {
			Type               string    `json:"type"`
			Status             string    `json:"status"`
			LastTransitionTime time.Time `json:"lastTransitionTime"`
		} `json:"conditions"`
	} `json:"status"`
}

func (p podInfo) since(cond string) (time.Time, bool) {
	for _, c := range p.Status.Conditions {
		if c.Type == cond && c.Status == "True" {
			return c.LastTransitionTime, true
		}
	}
	return time.Time{}, false
}

func componentPods(component string) []podInfo {
	GinkgoHelper()
	var l struct {
		Items []podInfo `json:"items"`
	}
	Expect(json.Unmarshal([]byte(must("", "-n", ns, "get", "pods", "-l", "app.kubernetes.io/component="+component, "-o", "json")), &l)).To(Succeed())
	return l.Items
}

// expectRolledOut checks that every pod of every component runs the
// images, one pod of each DaemonSet per node, and that the instance
// managers rolled as the design says: after the CSI node plugins were all
// Ready, and each one created only after the one before it had its
// readiness gate True (one node at a time, the next once the last served
// its volumes again).
func expectRolledOut(im images, nodeCount int) {
	GinkgoHelper()
	want := map[string]map[string]string{
		"manager":          {"manager": im.manager},
		"csi-controller":   {"csi": im.csi},
		"csi-node":         {"csi": im.csi, "device-keeper": im.data},
		"instance-manager": {"instance-manager": im.data},
	}
	for component, containers := range want {
		pods := componentPods(component)
		Expect(pods).NotTo(BeEmpty(), component)
		for _, p := range pods {
			for _, c := range p.Spec.Containers {
				if w, ok := containers[c.Name]; ok {
					Expect(c.Image).To(Equal(w), "pod %s container %s", p.Metadata.Name, c.Name)
				}
			}
		}
	}
	csiNodes, ims := componentPods("csi-node"), componentPods("instance-manager")
	Expect(csiNodes).To(HaveLen(nodeCount))
	Expect(ims).To(HaveLen(nodeCount))
	var lastKeeper time.Time
	for _, p := range csiNodes {
		ready, ok := p.since("Ready")
		Expect(ok).To(BeTrue(), "CSI node plugin %s Ready", p.Metadata.Name)
		if ready.After(lastKeeper) {
			lastKeeper = ready
		}
	}
	sort.Slice(ims, func(i, j int) bool {
		return ims[i].Metadata.CreationTimestamp.Before(ims[j].Metadata.CreationTimestamp)
	})
	for i, p := range ims {
		Expect(p.Metadata.CreationTimestamp).NotTo(BeTemporally("<", lastKeeper),
			"instance manager %s on %s created before the last CSI node plugin was Ready (%s)", p.Metadata.Name, p.Spec.NodeName, lastKeeper)
		gate, ok := p.since("storage.cairn.io/volumes-ready")
		Expect(ok).To(BeTrue(), "the readiness gate of %s is True", p.Metadata.Name)
		if i > 0 {
			prev := ims[i-1]
			prevGate, _ := prev.since("storage.cairn.io/volumes-ready")
			Expect(p.Metadata.CreationTimestamp).NotTo(BeTemporally("<", prevGate),
				"instance manager %s on %s created before %s on %s served its volumes again", p.Metadata.Name, p.Spec.NodeName, prev.Metadata.Name, prev.Spec.NodeName)
		}
		GinkgoWriter.Printf("instance manager %s on %s: created %s, volumes ready %s\n", p.Metadata.Name, p.Spec.NodeName,
			p.Metadata.CreationTimestamp.Format(time.TimeOnly), gate.Format(time.TimeOnly))
	}
	for _, p := range ims {
		Eventually(func() string {
			out, _ := kubectl("", "-n", ns, "get", "instancemanagers.storage.cairn.io", "im-"+p.Spec.NodeName, "-o", "jsonpath={.status.state}/{.status.version}")
			return out
		}, deadline.Scale(time.Minute), 2*time.Second).Should(MatchRegexp(`^running/.+`), "instance manager on %s running and reporting its version", p.Spec.NodeName)
	}
}

// redundancy samples, while a deploy runs, the fewest RW replicas each
// volume's running engine reported: the roll must never leave a volume
// without one, and (the readiness gate's work) should leave two of three.
type redundancy struct {
	mu       sync.Mutex
	fewest   map[string]int
	samples  int
	stop     chan struct{}
	finished chan struct{}
}

func watchRedundancy(vols []string) *redundancy {
	r := &redundancy{fewest: map[string]int{}, stop: make(chan struct{}), finished: make(chan struct{})}
	engines := map[string]bool{}
	for _, v := range vols {
		engines[v+"-e"] = true
	}
	go func() {
		defer GinkgoRecover()
		defer close(r.finished)
		for {
			select {
			case <-r.stop:
				return
			case <-time.After(2 * time.Second):
			}
			out, err := kubectl("", "-n", ns, "get", "engines.storage.cairn.io", "-o", "json")
			if err != nil {
				continue // the API server is busy: the next sample
			}
			var l struct {
				Items []struct {
					Metadata struct {
						Name string `json:"name"`
					} `json:"metadata"`
					Status struct {
						InstanceState  string            `json:"instanceState"`
						ReplicaModeMap map[string]string `json:"replicaModeMap"`
					} `json:"status"`
				} `json:"items"`
			}
			if json.Unmarshal([]byte(out), &l) != nil {
				continue
			}
			r.mu.Lock()
			r.samples++
			for _, e := range l.Items {
				if !engines[e.Metadata.Name] || e.Status.InstanceState != "running" || len(e.Status.ReplicaModeMap) == 0 {
					continue
				}
				rw := 0
				for _, m := range e.Status.ReplicaModeMap {
					if m == "RW" {
						rw++
					}
				}
				if f, ok := r.fewest[e.Metadata.Name]; !ok || rw < f {
					r.fewest[e.Metadata.Name] = rw
				}
			}
			r.mu.Unlock()
		}
	}()
	return r
}

func (r *redundancy) end() (map[string]int, int) {
	close(r.stop)
	<-r.finished
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fewest, r.samples
}

var _ = Describe("an upgrade and a rollback under load", func() {
	It("rolls every component of a new build, and back, while five volumes are written: no I/O error, every fsynced record there", func() {
		n := nodes()
		first := deployedImages()
		next := images{manager: withTag(first.manager, "e2e-next"), data: withTag(first.data, "e2e-next"), csi: withTag(first.csi, "e2e-next")}
		Expect(next).NotTo(Equal(first), "the images are deployed under another tag than e2e-next")
		rolledBack := false
		DeferCleanup(func() {
			if !rolledBack {
				makeDeploy(first) // later specs, and the tree's kustomizations, get the first images again
			}
		})

		// Three fsync record writers on ext4, one per node, and fio with
		// verify on an ext4 volume and on a raw block volume.
		var writers, fios, vols []string
		for i := range 3 {
			claim := fmt.Sprintf("up-rec-%d", i)
			pvc(claim, "cairn", "256Mi", false, "")
			startPod(claim, n[i%len(n)], claim, false, appImage, recordWriter)
			writers = append(writers, claim)
		}
		fioLoop := func(job string) string {
			return "(n=0; while [ ! -f /tmp/stop ]; do fio " + job + " --output=/tmp/fio.out || { echo failed > /tmp/fio.rc; exit 1; }; " +
				"n=$((n+1)); echo $n > /tmp/fio.passes; done; echo ok > /tmp/fio.rc) >/tmp/fio.log 2>&1 & true"
		}
		pvc("up-fio-fs", "cairn", "256Mi", false, "")
		startPod("up-fio-fs", n[1%len(n)], "up-fio-fs", false, fioImage, fioLoop(fioJob))
		pvc("up-fio-blk", "cairn-block", "128Mi", true, "")
		startPod("up-fio-blk", n[2%len(n)], "up-fio-blk", true, fioImage, fioLoop(strings.Replace(fioJob, "--filename=/data/fio", "--filename=/dev/xvda", 1)))
		fios = []string{"up-fio-fs", "up-fio-blk"}
		for _, p := range append(append([]string{}, writers...), fios...) {
			waitPod(p, 4*time.Minute)
			vols = append(vols, volumeOf(p))
		}
		for _, v := range vols {
			Eventually(robustness(v), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"), "volume %s", v)
		}
		fioState := func(pod, file string) string {
			out, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/"+file+" 2>/dev/null")
			return out
		}
		fioPasses := func(pod string) func() int {
			return func() int {
				var p int
				if _, err := fmt.Sscan(fioState(pod, "fio.passes"), &p); err != nil {
					return -1 // not written yet
				}
				return p
			}
		}
		fioLog := func(pod string) string { return fioState(pod, "fio.log") + fioState(pod, "fio.out") }
		for _, p := range fios {
			Eventually(fioPasses(p), deadline.Scale(3*time.Minute), time.Second).Should(BeNumerically(">=", 1), "a first verified fio pass in %s", p)
		}

		// Every check after a deploy: the components run the images, rolled
		// in order; every volume healthy; the writers and fio went on
		// through it without one error.
		underLoad := func(what string, im images) {
			GinkgoHelper()
			acked := map[string]int{}
			for _, w := range writers {
				Eventually(func() int { return writerState(w, "acked") }, deadline.Scale(time.Minute), time.Second).Should(BeNumerically(">=", 10))
				acked[w] = writerState(w, "acked")
			}
			passes := map[string]int{}
			for _, p := range fios {
				passes[p] = fioPasses(p)()
			}
			watch := watchRedundancy(vols)
			makeDeploy(im)
			fewest, samples := watch.end()
			GinkgoWriter.Printf("%s: fewest RW replicas seen per engine during the deploy (%d samples): %v\n", what, samples, fewest)
			for e, rw := range fewest {
				Expect(rw).To(BeNumerically(">=", 1), "%s: engine %s served with no RW replica", what, e)
			}
			expectRolledOut(im, len(n))
			for _, v := range vols {
				Eventually(robustness(v), deadline.Scale(4*time.Minute), time.Second).Should(Equal("healthy"), "%s: volume %s healthy", what, v)
				Expect(volumeField(v, "{.status.state}")).To(Equal("attached"))
			}
			for _, w := range writers {
				Eventually(func() int { return writerState(w, "acked") }, deadline.Scale(3*time.Minute), time.Second).Should(BeNumerically(">", acked[w]+10),
					"%s: writer %s makes progress", what, w)
				Expect(writerState(w, "errors")).To(Equal(0), "%s: I/O errors seen by %s: %s", what, w, podExec(w, "cat /tmp/werr 2>/dev/null; true"))
				gap, end := writerState(w, "maxgap"), time.Unix(int64(writerState(w, "maxgapend")), 0).UTC()
				GinkgoWriter.Printf("%s: %s longest pause between fsyncs so far %d ms, from %s to %s\n", what, w, gap,
					end.Add(-time.Duration(gap)*time.Millisecond).Format(time.TimeOnly), end.Format(time.TimeOnly))
			}
			for _, p := range fios {
				Expect(fioState(p, "fio.rc")).To(BeEmpty(), "%s: fio in %s still running without an error: %s", what, p, fioLog(p))
				Eventually(fioPasses(p), deadline.Scale(3*time.Minute), time.Second).Should(BeNumerically(">", passes[p]), "%s: fio in %s verifies another pass: %s", what, p, fioLog(p))
			}
		}

		By("an upgrade to " + next.manager + ", " + next.data + ", " + next.csi)
		retagAndLoad(first, next)
		underLoad("upgrade", next)

		By("a rollback to " + first.manager + ", " + first.data + ", " + first.csi)
		underLoad("rollback", first)
		rolledBack = true

		for _, w := range writers {
			acked := checkRecords(w)
			GinkgoWriter.Printf("%s: %d records, every one fsynced and present, through an upgrade and a rollback\n", w, acked)
		}
		for _, p := range fios {
			podExec(p, "touch /tmp/stop")
			Eventually(func() string { return fioState(p, "fio.rc") }, deadline.Scale(3*time.Minute), time.Second).Should(Equal("ok"), fioLog(p))
		}
	})
})
