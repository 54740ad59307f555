//go:build e2e

package e2e

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/cairn-io/cairn/dataplane/testutil/deadline"
)

// recordWriter appends "rec N" to /data/log with fsync every 0.2 s until
// /tmp/stop exists. After each append it writes N to /tmp/acked when the
// fsync succeeded, or counts a failure in /tmp/errors; /tmp/maxgap holds
// the longest time in milliseconds between two successful appends (the
// pause an application saw), /tmp/maxgapend when it ended (Unix seconds). The log's first acked lines must be exactly
// rec 1 .. rec acked.
const recordWriter = `cd /data && : > log && echo 0 > /tmp/errors && echo 0 > /tmp/acked && echo 0 > /tmp/maxgap
(i=0; errs=0; max=0; last=$(date +%s%3N)
while [ ! -f /tmp/stop ]; do
  i=$((i+1))
  if echo "rec $i" | dd of=/data/log oflag=append conv=notrunc,fsync status=none 2>>/tmp/werr; then
    echo $i > /tmp/acked
    now=$(date +%s%3N); gap=$((now-last)); last=$now
    if [ $gap -gt $max ]; then max=$gap; echo $max > /tmp/maxgap; echo $((now/1000)) > /tmp/maxgapend; fi
  else
    errs=$((errs+1)); echo $errs > /tmp/errors; i=$((i-1))
  fi
  sleep 0.2
done; echo done > /tmp/writer) >/tmp/writer.log 2>&1 &
true`

// writerState reads one of the record writer's counters.
func writerState(pod, file string) int {
	out, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/"+file+" 2>/dev/null || echo -1")
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		return -1
	}
	return n
}

// checkRecords stops the writer and checks that the log holds exactly
// rec 1 .. rec acked, each once and in order, on a filesystem that is
// still writable.
func checkRecords(pod string) int {
	GinkgoHelper()
	podExec(pod, "touch /tmp/stop")
	Eventually(func() string {
		out, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/writer 2>/dev/null")
		return out
	}, deadline.Scale(2*time.Minute), time.Second).Should(Equal("done"))
	acked := writerState(pod, "acked")
	Expect(acked).To(BeNumerically(">", 0))
	podExec(pod, fmt.Sprintf("seq 1 %d | sed 's/^/rec /' > /tmp/want && head -n %d /data/log | cmp - /tmp/want", acked, acked))
	podExec(pod, "touch /data/still-writable && sync")
	return acked
}

// deleteInstanceManager deletes the instance-manager pod of node, as a
// crash, an OOM kill or a rolling update of the DaemonSet does, and waits
// for its replacement to run.
func deleteInstanceManager(node string) {
	GinkgoHelper()
	sel := []string{"-n", ns, "get", "pod", "-l", "app.kubernetes.io/component=instance-manager", "--field-selector", "spec.nodeName=" + node}
	old := must("", append(sel, "-o", "jsonpath={.items[*].metadata.name}")...)
	oldIP := must("", append(sel, "-o", "jsonpath={.items[*].status.podIP}")...)
	must("", "-n", ns, "delete", "pod", old, "--wait=false")
	Eventually(func() string {
		out, _ := kubectl("", append(sel, "-o", `jsonpath={.items[?(@.status.phase=="Running")].metadata.name}`)...)
		return out
	}, deadline.Scale(3*time.Minute), time.Second).ShouldNot(Or(BeEmpty(), Equal(old)), "a new instance-manager pod on %s", node)
	GinkgoWriter.Printf("instance manager on %s: %s (%s) replaced by %s (%s)\n", node, old, oldIP,
		must("", append(sel, "-o", "jsonpath={.items[*].metadata.name}")...), must("", append(sel, "-o", "jsonpath={.items[*].status.podIP}")...))
}

// killEngine SIGKILLs the engine process of vol on its node. The
// pattern's [c] keeps pkill from matching (and killing) the shell that
// runs it, whose command line holds the pattern.
func killEngine(node, vol string) {
	GinkgoHelper()
	docker("exec", node, "pkill", "-KILL", "-f", fmt.Sprintf("[c]airn-data engine .*%s", vol))
}

// maxWriterPause bounds the longest wait between two acknowledged appends
// of the record writer through a data-plane restart (issue #27's target on
// the CI machine type), scaled by CAIRN_TEST_DEADLINE_SCALE.
const maxWriterPause = 10 * time.Second

var _ = Describe("day 2: the data plane restarted under a writing application", func() {
	for _, fault := range []string{"instance-manager pod deleted", "engine process killed"} {
		It(fmt.Sprintf("pauses, never fails, an fsync writer when its node's %s", fault), func() {
			n := nodes()
			app := n[1]
			claim := "d2-" + strings.Fields(fault)[0]
			pvc(claim, "cairn", "256Mi", false, "")
			startPod(claim, app, claim, false, appImage, recordWriter)
			waitPod(claim, 4*time.Minute)
			vol := volumeOf(claim)
			Expect(volumeField(vol, "{.status.currentNodeName}")).To(Equal(app))
			Eventually(robustness(vol), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"))
			Eventually(func() int { return writerState(claim, "acked") }, deadline.Scale(time.Minute), time.Second).Should(BeNumerically(">=", 10))
			before := writerState(claim, "acked")
			start := time.Now()
			if fault == "engine process killed" {
				killEngine(app, vol)
			} else {
				deleteInstanceManager(app)
			}
			// Writes go on: the writer gets past what it had before the fault.
			Eventually(func() int { return writerState(claim, "acked") }, deadline.Scale(3*time.Minute), time.Second).Should(BeNumerically(">", before+10),
				"the writer makes progress again after the %s", fault)
			Eventually(robustness(vol), deadline.Scale(4*time.Minute), time.Second).Should(Equal("healthy"), "volume %s healthy again", vol)
			pause := time.Duration(writerState(claim, "maxgap")) * time.Millisecond
			GinkgoWriter.Printf("%s: healthy again %s after the fault; longest pause between fsyncs %s\n", fault, time.Since(start).Round(time.Second), pause)
			Expect(writerState(claim, "errors")).To(Equal(0), "I/O errors seen by the application: %s",
				podExec(claim, "cat /tmp/werr 2>/dev/null; true"))
			acked := checkRecords(claim)
			GinkgoWriter.Printf("%s: %d records, every one fsynced and present\n", fault, acked)
			Expect(pause).To(BeNumerically(">", 0), "the writer's longest pause")
			if fault == "instance-manager pod deleted" {
				// Issue #27's bound on the CI machine type (3.8 to 6.6 s
				// measured in four runs, docs/reliability.md). Not asserted for a killed
				// engine: it leaves the write-intent bits of its last
				// writes (here mkfs's, every region) for the next engine to
				// reconcile, 7.6 s measured, too close to the bound.
				Expect(pause).To(BeNumerically("<", deadline.Scale(maxWriterPause)), "the longest pause between two fsyncs the application saw")
			}
			Expect(volumeField(vol, "{.status.state}")).To(Equal("attached"))
		})
	}
})

// fioLoop runs fio with job again and again until /tmp/stop exists;
// /tmp/fio.passes counts the passes that verified, /tmp/fio.rc says
// "failed" at the first error (fio exits non-zero on an I/O error or a
// verify failure) or "ok" once stopped.
func fioLoop(job string) string {
	return "(n=0; while [ ! -f /tmp/stop ]; do fio " + job + " --output=/tmp/fio.out || { echo failed > /tmp/fio.rc; exit 1; }; " +
		"n=$((n+1)); echo $n > /tmp/fio.passes; done; echo ok > /tmp/fio.rc) >/tmp/fio.log 2>&1 & true"
}

// fioPasses reads a fioLoop pod's count of verified passes.
func fioPasses(pod string) int {
	out, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/fio.passes 2>/dev/null || echo 0")
	p, _ := strconv.Atoi(strings.TrimSpace(out))
	return p
}

// fioResult reads a fioLoop pod's result ("" while it runs) and its output.
func fioResult(pod string) (string, string) {
	rc, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/fio.rc 2>/dev/null")
	out, _ := kubectl("", "-n", "default", "exec", pod, "--", "sh", "-c", "cat /tmp/fio.log /tmp/fio.out 2>/dev/null")
	return rc, out
}

var _ = Describe("day 2: the data plane restarted under fio --verify", func() {
	It("keeps fio verifying without an error on ext4 and on a raw block volume, through an instance-manager pod deleted and engines killed", func() {
		n := nodes()
		app := n[1]
		pvc("d2-fio-fs", "cairn", "256Mi", false, "")
		pvc("d2-fio-blk", "cairn-block", "128Mi", true, "")
		startPod("d2-fio-fs", app, "d2-fio-fs", false, fioImage, fioLoop(fioJob))
		startPod("d2-fio-blk", app, "d2-fio-blk", true, fioImage, fioLoop(strings.Replace(fioJob, "--filename=/data/fio", "--filename=/dev/xvda", 1)))
		pods := []string{"d2-fio-fs", "d2-fio-blk"}
		var vols []string
		for _, p := range pods {
			waitPod(p, 4*time.Minute)
			vols = append(vols, volumeOf(p))
		}
		for _, v := range vols {
			Expect(volumeField(v, "{.status.currentNodeName}")).To(Equal(app))
			Eventually(robustness(v), deadline.Scale(2*time.Minute), time.Second).Should(Equal("healthy"))
		}
		progress := func(what string) {
			GinkgoHelper()
			for _, p := range pods {
				at := fioPasses(p)
				Eventually(func() int { return fioPasses(p) }, deadline.Scale(4*time.Minute), time.Second).Should(BeNumerically(">", at),
					"%s: a verified fio pass in %s after %s", p, p, what)
				rc, out := fioResult(p)
				Expect(rc).To(BeEmpty(), "%s: fio stopped after %s:\n%s", p, what, out)
			}
			for _, v := range vols {
				Eventually(robustness(v), deadline.Scale(4*time.Minute), time.Second).Should(Equal("healthy"), "volume %s healthy again after %s", v, what)
			}
		}
		progress("start")
		deleteInstanceManager(app)
		progress("the instance-manager pod was deleted")
		for _, v := range vols {
			killEngine(app, v)
		}
		progress("the engines were killed")
		for _, p := range pods {
			podExec(p, "touch /tmp/stop")
			Eventually(func() string { rc, _ := fioResult(p); return rc }, deadline.Scale(3*time.Minute), time.Second).Should(Equal("ok"),
				func() string { _, out := fioResult(p); return out })
		}
	})
})
