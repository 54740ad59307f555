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

// s3Image runs versitygw, an S3 server over a directory, as the backup
// target in the cluster (hack/e2e-s3; hack/test-e2e.sh builds it and loads
// it into the nodes).
var s3Image = envOr("E2E_S3_IMAGE", "cairn-e2e-s3:local")

const (
	s3NS        = "cairn-e2e-s3"
	s3Bucket    = "cairn-e2e"
	s3Access    = "cairn-e2e-access"
	s3Secret    = "cairn-e2e-secret-key"
	e2eTarget   = "e2e-s3"
	backupClass = "cairn-e2e-backup"
)

// deployS3 runs versitygw in its own namespace with an empty bucket, and a
// BackupTarget naming it, and waits until the manager finds it available.
func deployS3() {
	GinkgoHelper()
	must(fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: %[1]s}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: s3, namespace: %[1]s}
spec:
  selector: {matchLabels: {app: s3}}
  template:
    metadata: {labels: {app: s3}}
    spec:
      containers:
      - name: versitygw
        image: %[2]s
        imagePullPolicy: IfNotPresent
        # A bucket of the posix backend is a directory of its root.
        command: ["sh", "-c", "mkdir -p /data/%[3]s && exec versitygw --access %[4]s --secret %[5]s --port :7070 posix /data"]
        ports: [{containerPort: 7070}]
        readinessProbe: {tcpSocket: {port: 7070}, periodSeconds: 1}
        volumeMounts: [{name: data, mountPath: /data}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: v1
kind: Service
metadata: {name: s3, namespace: %[1]s}
spec:
  selector: {app: s3}
  ports: [{port: 7070}]
---
apiVersion: v1
kind: Secret
metadata: {name: %[6]s-credentials, namespace: %[7]s}
stringData: {AWS_ACCESS_KEY_ID: %[4]s, AWS_SECRET_ACCESS_KEY: %[5]s}
---
apiVersion: storage.cairn.io/v1alpha1
kind: BackupTarget
metadata: {name: %[6]s}
spec:
  s3:
    endpoint: http://s3.%[1]s.svc.cluster.local:7070
    bucket: %[3]s
    region: us-east-1
    pathStyle: true
    credentialsSecret: {name: %[6]s-credentials, namespace: %[7]s}
  pollInterval: 30s
---
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshotClass
metadata: {name: %[8]s}
driver: storage.cairn.io
deletionPolicy: Delete
parameters: {type: backup, backupTarget: %[6]s}
`, s3NS, s3Image, s3Bucket, s3Access, s3Secret, e2eTarget, ns, backupClass), "apply", "-f", "-")
	DeferCleanup(func() {
		_, _ = kubectl("", "delete", "volumesnapshotclass", backupClass, "--ignore-not-found")
		_, _ = kubectl("", "delete", "backuptarget", e2eTarget, "--ignore-not-found")
		_, _ = kubectl("", "-n", ns, "delete", "secret", e2eTarget+"-credentials", "--ignore-not-found")
		_, _ = kubectl("", "delete", "namespace", s3NS, "--ignore-not-found", "--wait=false")
	})
	must("", "-n", s3NS, "rollout", "status", "deploy/s3", timeoutFlag(3*time.Minute))
	if _, err := kubectl("", "wait", "backuptarget/"+e2eTarget, "--for=condition=Available", timeoutFlag(2*time.Minute)); err != nil {
		out, _ := kubectl("", "get", "backuptarget", e2eTarget, "-o", "yaml")
		Fail(fmt.Sprintf("BackupTarget %s not available: %v\n%s", e2eTarget, err, out))
	}
}

var _ = Describe("a claim backed up by a VolumeSnapshot of the backup class", func() {
	It("is restored from S3 into a larger claim on another node after the claim is deleted", func() {
		n := nodes()
		deployS3()

		By("writing 16 MiB and its checksum on " + n[1])
		pvc("bak", "cairn", "128Mi", false, "")
		pod("bak-w", n[1], "bak", false, "cd /data && dd if=/dev/urandom of=f bs=1M count=16 status=none && sha256sum f > sum && sync")
		source := volumeOf("bak")

		By("a VolumeSnapshot of the backup class, ready once uploaded")
		must(fmt.Sprintf(`apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: bak-snap, namespace: default}
spec:
  volumeSnapshotClassName: %s
  source: {persistentVolumeClaimName: bak}
`, backupClass), "apply", "-f", "-")
		DeferCleanup(func() {
			_, _ = kubectl("", "-n", "default", "delete", "volumesnapshot", "bak-snap", "--ignore-not-found", "--wait=true", "--timeout=3m")
		})
		Eventually(func() string {
			out, _ := kubectl("", "-n", "default", "get", "volumesnapshot", "bak-snap", "-o", "jsonpath={.status.readyToUse}")
			return out
		}, deadline.Scale(5*time.Minute), 2*time.Second).Should(Equal("true"), "the backup is uploaded")
		handle := must("", "get", "volumesnapshotcontent", "-o",
			`jsonpath={range .items[?(@.spec.volumeSnapshotRef.name=="bak-snap")]}{.status.snapshotHandle}{end}`)
		Expect(handle).To(HavePrefix("backup:"), "the snapshot is a backup")
		backup := strings.TrimPrefix(handle, "backup:")
		Expect(must("", "-n", ns, "get", "backups.storage.cairn.io", backup, "-o", "jsonpath={.status.state}")).To(Equal("completed"))

		By("a RecurringJob backing the volume up every minute keeps one backup")
		must("", "-n", ns, "label", "volumes.storage.cairn.io", source, "storage.cairn.io/recurring-job-group.e2e=enabled")
		must(fmt.Sprintf(`apiVersion: storage.cairn.io/v1alpha1
kind: RecurringJob
metadata: {name: e2e-rj, namespace: %s}
spec: {schedule: "* * * * *", task: backup, target: %s, retain: 1, groups: [e2e]}
`, ns, e2eTarget), "apply", "-f", "-")
		jobBackups := func() []string {
			out, _ := kubectl("", "-n", ns, "get", "backups.storage.cairn.io", "-l", "storage.cairn.io/recurring-job=e2e-rj",
				"-o", `jsonpath={range .items[*]}{.metadata.name}={.status.state}{"\n"}{end}`)
			return strings.Fields(out)
		}
		DeferCleanup(func() {
			_, _ = kubectl("", "-n", ns, "delete", "recurringjob", "e2e-rj", "--ignore-not-found")
			_, _ = kubectl("", "-n", ns, "delete", "backups.storage.cairn.io", "-l", "storage.cairn.io/recurring-job=e2e-rj", "--wait=true", "--timeout=3m")
		})
		var first string
		Eventually(func() []string {
			b := jobBackups()
			if len(b) > 0 && first == "" {
				first, _, _ = strings.Cut(b[0], "=")
			}
			return b
		}, deadline.Scale(3*time.Minute), 2*time.Second).Should(ContainElement(HaveSuffix("=completed")), "the job's first backup completes")
		// A run starts every minute, so the moment when a later backup is
		// the only one can be shorter than a poll on a loaded machine:
		// wait for a later one to complete, suspend the job, and let what
		// is in flight finish and the pruning catch up.
		Eventually(func() []string {
			var later []string
			for _, b := range jobBackups() {
				if !strings.HasPrefix(b, first+"=") && strings.HasSuffix(b, "=completed") {
					later = append(later, b)
				}
			}
			return later
		}, deadline.Scale(4*time.Minute), 2*time.Second).ShouldNot(BeEmpty(), "a later run's backup completes; the first was %s", first)
		must("", "-n", ns, "patch", "recurringjob", "e2e-rj", "--type=merge", "-p", `{"spec":{"suspend":true}}`)
		Eventually(func() []string {
			return jobBackups()
		}, deadline.Scale(4*time.Minute), 2*time.Second).Should(And(HaveLen(1), ContainElement(HaveSuffix("=completed")), Not(ContainElement(HavePrefix(first+"=")))),
			"with the job suspended, only the newest completed backup is kept (retain 1); the first was %s", first)
		must("", "-n", ns, "delete", "recurringjob", "e2e-rj")

		By("deleting the claim and its volume")
		deletePod("bak-w")
		must("", "-n", "default", "delete", "pvc", "bak", "--wait=true", timeoutFlag(3*time.Minute))
		Eventually(func() string {
			out, _ := kubectl("", "-n", ns, "get", "volumes.storage.cairn.io", source, "--ignore-not-found", "-o", "name")
			return out
		}, deadline.Scale(3*time.Minute), 2*time.Second).Should(BeEmpty(), "the source volume is deleted")

		By("restoring into a claim twice the size, on " + n[2])
		pvc("bak-restored", "cairn", "256Mi", false, "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: bak-snap}")
		pod("bak-r", n[2], "bak-restored", false, "cd /data && sha256sum -c sum")
		df := podExec("bak-r", "df -k /data | tail -1 | awk '{print $2}'")
		kib, err := strconv.Atoi(strings.TrimSpace(df))
		Expect(err).NotTo(HaveOccurred(), "df: %q", df)
		Expect(kib).To(BeNumerically(">", 128*1024), "the filesystem was grown to the claim's size")

		By("deleting the VolumeSnapshot deletes the backup")
		deletePod("bak-r")
		must("", "-n", "default", "delete", "volumesnapshot", "bak-snap", "--wait=true", timeoutFlag(3*time.Minute))
		Eventually(func() string {
			out, _ := kubectl("", "-n", ns, "get", "backups.storage.cairn.io", backup, "--ignore-not-found", "-o", "name")
			return out
		}, deadline.Scale(3*time.Minute), 2*time.Second).Should(BeEmpty(), "the Backup is gone")
	})
})
