//go:build chaoscluster

package chaoscluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// workNS is the namespace of the run's claims and pods; deleting it at the
// end removes everything the run created there.
const workNS = "cairn-chaos"

// workloadKind is what a workload pod does.
type workloadKind string

const (
	// kindWriter appends numbered, checksummed records to a file on an
	// ext4 volume, each fsynced before it counts as acknowledged.
	kindWriter workloadKind = "writer"
	// kindFio runs fio with --verify on a raw block volume, pass after pass.
	kindFio workloadKind = "fio"
)

// workload is one claim and the pod using it.
type workload struct {
	name   string // the pod's and the claim's name
	kind   workloadKind
	node   string
	volume string // the Volume (PV) name, once bound
}

// recordPrefix salts each record's checksum.
const recordPrefix = "cairn-chaos"

// writerScript appends "rec N <checksum>" to /data/log with fsync every
// 0.2 s until /tmp/stop exists. After each append it writes N to
// /tmp/acked when the fsync succeeded, or counts a failure in
// /tmp/errors; /tmp/maxgap holds the longest time in milliseconds between
// two successful appends (the longest pause the application saw).
const writerScript = `cd /data && : > log && echo 0 > /tmp/errors && echo 0 > /tmp/acked && echo 0 > /tmp/maxgap
(i=0; errs=0; max=0; last=$(date +%s%3N)
while [ ! -f /tmp/stop ]; do
  i=$((i+1))
  sum=$(printf '` + recordPrefix + ` %d' $i | sha256sum | cut -c1-16)
  if printf 'rec %d %s\n' $i $sum | dd of=/data/log oflag=append conv=notrunc,fsync status=none 2>>/tmp/werr; then
    echo $i > /tmp/acked
    now=$(date +%s%3N); gap=$((now-last)); last=$now
    if [ $gap -gt $max ]; then max=$gap; echo $max > /tmp/maxgap; fi
  else
    errs=$((errs+1)); echo $errs > /tmp/errors; i=$((i-1))
  fi
  sleep 0.2
done; echo done > /tmp/writer) >/tmp/writer.log 2>&1 &
true`

// record is the line the writer appends as record i.
func record(i int) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s %d", recordPrefix, i)))
	return fmt.Sprintf("rec %d %s", i, hex.EncodeToString(sum[:])[:16])
}

// fioJob writes 16 MiB of random 4 KiB blocks of the raw device with
// O_DIRECT and verifies each block's crc32c; verify_fatal stops at the
// first mismatch.
const fioJob = "--name=v --filename=/dev/xvda --size=16m --bs=4k --rw=randwrite --ioengine=libaio --iodepth=8 --direct=1 --verify=crc32c --verify_fatal=1"

// fioScript runs fioJob until /tmp/stop exists; /tmp/fio.passes counts
// the passes that verified, /tmp/fio.rc says "failed" at the first error
// (fio exits non-zero on an I/O error or a verify failure) or "ok" once
// stopped.
const fioScript = "(n=0; while [ ! -f /tmp/stop ]; do fio " + fioJob + " --output=/tmp/fio.out || { echo failed > /tmp/fio.rc; exit 1; }; " +
	"n=$((n+1)); echo $n > /tmp/fio.passes; done; echo ok > /tmp/fio.rc) >/tmp/fio.log 2>&1 & true"

// images are the pods' images (already loaded into the kind nodes).
type images struct{ app, fio string }

// manifest is the claim and the pod of w.
func (w *workload) manifest(im images) string {
	class, mode, size, image, script := "cairn", "Filesystem", "256Mi", im.app, writerScript
	vol := "volumeMounts: [{name: d, mountPath: /data}]"
	if w.kind == kindFio {
		class, mode, size, image, script = "cairn-block", "Block", "128Mi", im.fio, fioScript
		vol = "volumeDevices: [{name: d, devicePath: /dev/xvda}]"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: %[1]s, namespace: %[2]s}
spec:
  storageClassName: %[3]s
  volumeMode: %[4]s
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: %[5]s}}
---
apiVersion: v1
kind: Pod
metadata: {name: %[1]s, namespace: %[2]s, labels: {app.kubernetes.io/part-of: cairn-chaos}}
spec:
  nodeName: %[6]s
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %[7]s
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", %[8]q]
    readinessProbe: {exec: {command: ["test", "-f", "/tmp/ready"]}, periodSeconds: 1}
    %[9]s
  volumes:
  - {name: d, persistentVolumeClaim: {claimName: %[1]s}}
`, w.name, workNS, class, mode, size, w.node, image, script+" && touch /tmp/ready && sleep infinity", vol)
}

// exec runs a shell script in the workload's pod.
func (w *workload) exec(ctx context.Context, c *cluster, script string) (string, error) {
	return c.kubectl(ctx, "", "-n", workNS, "exec", w.name, "--", "sh", "-c", script)
}

// counter reads one of the pod's counter files (-1 if unreadable).
func (w *workload) counter(ctx context.Context, c *cluster, file string) int {
	out, err := w.exec(ctx, c, "cat /tmp/"+file+" 2>/dev/null || echo 0")
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		return -1
	}
	return n
}

// progress is the workload's count of done work: records acknowledged,
// or fio passes verified.
func (w *workload) progress(ctx context.Context, c *cluster) int {
	if w.kind == kindFio {
		return w.counter(ctx, c, "fio.passes")
	}
	return w.counter(ctx, c, "acked")
}

// startWorkloads creates the claims and pods and waits until every pod is
// Ready and its volume attached and healthy.
func (r *runner) startWorkloads(ctx context.Context) error {
	c := r.c
	if _, err := c.kubectl(ctx, "", "create", "namespace", workNS); err != nil {
		if _, gerr := c.kubectl(ctx, "", "get", "namespace", workNS); gerr != nil {
			return err
		}
	}
	for _, w := range r.workloads {
		if _, err := c.kubectl(ctx, w.manifest(r.images), "apply", "-f", "-"); err != nil {
			return err
		}
	}
	for _, w := range r.workloads {
		if _, err := c.kubectlFor(ctx, 6*time.Minute, "-n", workNS, "wait", "pod/"+w.name, "--for=condition=Ready", "--timeout=300s"); err != nil {
			desc, _ := c.kubectl(ctx, "", "-n", workNS, "describe", "pod", w.name)
			return fmt.Errorf("pod %s not ready: %w\n%s", w.name, err, desc)
		}
		v, err := c.kubectl(ctx, "", "-n", workNS, "get", "pvc", w.name, "-o", "jsonpath={.spec.volumeName}")
		if err != nil {
			return err
		}
		w.volume = v
	}
	if _, err := r.waitHealthy(ctx, healthyBound); err != nil {
		return err
	}
	return r.waitProgress(ctx, progressBound)
}

// waitProgress waits until every workload has done more work than now:
// a volume that serves no I/O is stuck, whatever its status says.
func (r *runner) waitProgress(ctx context.Context, bound time.Duration) error {
	for _, w := range r.workloads {
		at := w.progress(ctx, r.c)
		err := poll(ctx, bound, 2*time.Second, func() (bool, error) {
			now := w.progress(ctx, r.c)
			if now > at {
				return true, nil
			}
			return false, fmt.Errorf("%s (%s on %s) did no new work: %d", w.name, w.kind, w.volume, now)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// stopAndVerify stops the workload and checks what it did: every
// acknowledged record present and intact, in order, and no I/O error; or
// fio's passes all verified. It returns the problems found and a summary.
func (w *workload) stopAndVerify(ctx context.Context, c *cluster) (problems []string, summary string) {
	if _, err := w.exec(ctx, c, "touch /tmp/stop"); err != nil {
		return []string{fmt.Sprintf("%s: cannot stop it: %v", w.name, err)}, ""
	}
	if w.kind == kindFio {
		return w.verifyFio(ctx, c)
	}
	return w.verifyWriter(ctx, c)
}

func (w *workload) verifyWriter(ctx context.Context, c *cluster) ([]string, string) {
	err := poll(ctx, 2*time.Minute, time.Second, func() (bool, error) {
		out, _ := w.exec(ctx, c, "cat /tmp/writer 2>/dev/null")
		return out == "done", nil
	})
	if err != nil {
		return []string{fmt.Sprintf("%s: the writer did not stop: %v", w.name, err)}, ""
	}
	var problems []string
	acked, errs, gap := w.counter(ctx, c, "acked"), w.counter(ctx, c, "errors"), w.counter(ctx, c, "maxgap")
	if errs != 0 {
		werr, _ := w.exec(ctx, c, "tail -5 /tmp/werr 2>/dev/null; true")
		problems = append(problems, fmt.Sprintf("%s: the application saw %d failed appends: %s", w.name, errs, werr))
	}
	if acked <= 0 {
		return append(problems, fmt.Sprintf("%s: no record acknowledged (%d)", w.name, acked)), ""
	}
	log, err := w.exec(ctx, c, fmt.Sprintf("head -n %d /data/log", acked))
	if err != nil {
		return append(problems, fmt.Sprintf("%s: reading the log: %v", w.name, err)), ""
	}
	if p := checkRecords(strings.Split(log, "\n"), acked); p != "" {
		problems = append(problems, fmt.Sprintf("%s on %s: %s", w.name, w.volume, p))
	}
	if _, err := w.exec(ctx, c, "touch /data/still-writable && sync"); err != nil {
		problems = append(problems, fmt.Sprintf("%s: the filesystem is no longer writable: %v", w.name, err))
	}
	return problems, fmt.Sprintf("%s: %d fsynced records present, longest pause between appends %d ms", w.name, acked, gap)
}

// checkRecords checks that lines are exactly records 1..acked.
func checkRecords(lines []string, acked int) string {
	if len(lines) < acked {
		return fmt.Sprintf("acknowledged write lost: %d records acknowledged, %d in the log", acked, len(lines))
	}
	for i := 1; i <= acked; i++ {
		if lines[i-1] != record(i) {
			return fmt.Sprintf("acknowledged write lost or damaged: line %d is %q, want %q", i, lines[i-1], record(i))
		}
	}
	return ""
}

func (w *workload) verifyFio(ctx context.Context, c *cluster) ([]string, string) {
	var rc string
	err := poll(ctx, 3*time.Minute, time.Second, func() (bool, error) {
		rc, _ = w.exec(ctx, c, "cat /tmp/fio.rc 2>/dev/null")
		return rc != "", nil
	})
	passes := w.counter(ctx, c, "fio.passes")
	if err != nil || rc != "ok" {
		out, _ := w.exec(ctx, c, "tail -30 /tmp/fio.log /tmp/fio.out 2>/dev/null")
		return []string{fmt.Sprintf("%s on %s: fio failed after %d verified passes (rc %q, %v):\n%s", w.name, w.volume, passes, rc, err, out)}, ""
	}
	return nil, fmt.Sprintf("%s: %d fio passes, every block verified", w.name, passes)
}
