package backuptarget

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"strings"

	"github.com/minio/minio-go/v7"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// ProbeDir is the reserved folder, under a target's prefix, where the
// check writes its probe object (<prefix>/.cairn-probe/<BackupTarget UID>).
// Backups never use it; the backup store's keys all start with volumes/.
const ProbeDir = ".cairn-probe/"

// probeSize is the probe object's length: small, and random so that a
// read-back proves the server stored this write.
const probeSize = 64

// stage is the step of a probe that failed.
type stage string

const (
	stageList   stage = "list"
	stageWrite  stage = "write"
	stageRead   stage = "read back"
	stageDelete stage = "delete"
)

// probe says what to check and how to name it in messages.
type probe struct {
	cfg     Config
	secret  v1.SecretReference // S3 only
	uid     string
	timeout string
}

// run lists the probe folder, writes the probe object, reads it back and
// deletes it, all under ctx's deadline. If it is killed after the write,
// the object stays under ProbeDir (one per BackupTarget, overwritten by
// the next check) and never mixes with backups.
func (p probe) run(ctx context.Context) result {
	tg, err := p.cfg.Open()
	if err != nil {
		return *failed(v1.BackupTargetReasonProbeFailed, "cannot build a client for %s: %v", p.endpoint(), err)
	}
	defer CloseTarget(tg)
	stop := errors.New("stop listing")
	err = tg.List(ctx, ProbeDir, func(backupstore.Object) error { return stop })
	if err != nil && !errors.Is(err, stop) {
		return p.classify(stageList, err)
	}
	key := ProbeDir + p.uid
	want := make([]byte, probeSize)
	_, _ = rand.Read(want) // crypto/rand.Read never fails
	if err := tg.Put(ctx, key, want); err != nil {
		return p.classify(stageWrite, err)
	}
	got, err := readAll(ctx, tg, key)
	if err != nil {
		return p.classify(stageRead, err)
	}
	if !bytes.Equal(got, want) {
		return *failed(v1.BackupTargetReasonNotWritable,
			"the probe object %s read back differs from what was written (%d bytes, want %d: %s...): the server does not store objects faithfully",
			p.objectName(key), len(got), len(want), hex.EncodeToString(got[:min(len(got), 8)]))
	}
	if err := tg.Delete(ctx, key); err != nil {
		return p.classify(stageDelete, err)
	}
	return result{status: metav1.ConditionTrue, reason: v1.BackupTargetReasonAvailable,
		message: fmt.Sprintf("listed, wrote, read back and deleted %s", p.objectName(key))}
}

func readAll(ctx context.Context, tg backupstore.Target, key string) ([]byte, error) {
	rc, err := tg.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rc.Close() }()
	return io.ReadAll(io.LimitReader(rc, probeSize+1))
}

// objectName names key as the user sees it: bucket (or NFS server and
// export), prefix and key.
func (p probe) objectName(key string) string {
	var name, prefix string
	if c := p.cfg.NFS; c != nil {
		name, prefix = "nfs://"+c.Server+strings.TrimSuffix(c.Export, "/")+"/", c.Prefix
	} else {
		name, prefix = p.cfg.S3.Bucket+"/", p.cfg.S3.Prefix
	}
	if pre := trimSlashes(prefix); pre != "" {
		name += pre + "/"
	}
	return name + key
}

// endpoint names the server in messages.
func (p probe) endpoint() string {
	if c := p.cfg.NFS; c != nil {
		return "NFS server " + c.Server
	}
	return p.cfg.S3.Endpoint
}

// classify turns a failed step into a reason and a message naming the
// cause and the fix. The server's answer is read from minio-go's typed
// error (its S3 error code and HTTP status), never from error text.
func (p probe) classify(st stage, err error) result {
	var s3err minio.ErrorResponse
	if errors.As(err, &s3err) {
		return p.classifyS3(st, s3err)
	}
	if p.cfg.NFS != nil {
		if res, ok := p.classifyNFS(st, err); ok {
			return res
		}
	}
	var certErr *tls.CertificateVerificationError
	var unknownCA x509.UnknownAuthorityError
	var hostErr x509.HostnameError
	if errors.As(err, &certErr) || errors.As(err, &unknownCA) || errors.As(err, &hostErr) {
		return *failed(v1.BackupTargetReasonUnreachable,
			"%s does not present a certificate this manager trusts (%v): set spec.s3.caBundle to the CA that signed it, or fix the endpoint's host name",
			p.endpoint(), err)
	}
	var netErr net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, backupstore.ErrTimeout) {
		return *failed(v1.BackupTargetReasonUnreachable,
			"no answer from %s within %s (%s): check the endpoint and the network path from the manager's pod", p.endpoint(), p.timeout, st)
	}
	if errors.As(err, &netErr) {
		return *failed(v1.BackupTargetReasonUnreachable,
			"cannot reach %s (%s): %v: check the endpoint and the network path from the manager's pod", p.endpoint(), st, err)
	}
	return *failed(v1.BackupTargetReasonProbeFailed, "%s of %s failed: %v", st, p.objectName(ProbeDir+p.uid), err)
}

// classifyNFS maps the NFS server's refusals: no such export, and a
// refused client or permission (the MOUNT service's, the RPC layer's or
// the file's). Other failures are classified as for any target.
func (p probe) classifyNFS(st stage, err error) (result, bool) {
	c := p.cfg.NFS
	switch {
	case errors.Is(err, backupstore.ErrExportNotFound):
		return *failed(v1.BackupTargetReasonExportNotFound,
			"NFS server %s does not export %s: export it (and let the manager's pods in), or fix spec.nfs.path", c.Server, c.Export), true
	case errors.Is(err, fs.ErrPermission) && st == stageList:
		return *failed(v1.BackupTargetReasonAccessDenied,
			"NFS server %s refused export %s to the manager (%v): list the manager's pod IPs (or their network) among the export's clients, "+
				"with the option insecure (the manager connects from an unprivileged port)", c.Server, c.Export, err), true
	case errors.Is(err, fs.ErrPermission):
		return *failed(v1.BackupTargetReasonNotWritable,
			"NFS server %s let the manager list but not %s %s (%v): export %s read-write and make the directory writable by the user the server maps root to (no_root_squash, or a directory owned by the squashed user)",
			c.Server, st, p.objectName(ProbeDir+p.uid), err, c.Export), true
	}
	return result{}, false
}

// classifyS3 maps an answer of the S3 server.
func (p probe) classifyS3(st stage, e minio.ErrorResponse) result {
	switch {
	case e.Code == "NoSuchBucket":
		return *failed(v1.BackupTargetReasonBucketNotFound,
			"bucket %q does not exist at %s (NoSuchBucket): create it (Cairn never creates buckets) or fix spec.s3.bucket",
			p.cfg.S3.Bucket, p.cfg.S3.Endpoint)
	case e.StatusCode == http.StatusForbidden || e.Code == "AccessDenied" || e.Code == "SignatureDoesNotMatch" ||
		e.Code == "InvalidAccessKeyId" || e.Code == "InvalidToken" || e.Code == "ExpiredToken":
		if st == stageList {
			return *failed(v1.BackupTargetReasonAccessDenied,
				"%s refused the credentials in Secret %s/%s for bucket %q (%s: %s): check %s and %s, and that they may list the bucket",
				p.cfg.S3.Endpoint, p.secret.Namespace, p.secret.Name, p.cfg.S3.Bucket, e.Code, e.Message, KeyAccessKeyID, KeySecretAccessKey)
		}
		return *failed(v1.BackupTargetReasonNotWritable,
			"the credentials in Secret %s/%s may list bucket %q but not %s %s (%s: %s): grant them put, get and delete on the prefix",
			p.secret.Namespace, p.secret.Name, p.cfg.S3.Bucket, st, p.objectName(ProbeDir+p.uid), e.Code, e.Message)
	}
	return *failed(v1.BackupTargetReasonProbeFailed, "%s of %s failed: the server answered HTTP %d %s: %s",
		st, p.objectName(ProbeDir+p.uid), e.StatusCode, e.Code, e.Message)
}
