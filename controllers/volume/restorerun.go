package volume

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
)

// RestoreOptions configure the manager's restores of volumes from
// backups (spec.dataSource.backup).
type RestoreOptions struct {
	// Keys are the volumes' data-connection keys, for the engine a
	// restore runs in the manager (nil: the replicas take none, as in
	// tests without Cairn's CA).
	Keys certs.VolumeKeys
	// ControlTLS is the client TLS of the replicas' control APIs, and
	// DataTLS of their data ports (instance managers with --data-tls);
	// nil: plain.
	ControlTLS, DataTLS *tls.Config
	// Store tunes the backup store (timeouts, retries, concurrency).
	Store backupstore.Options
	// RetryAfter is how long a failed restore waits before it is tried
	// again from the start; default DefaultRestoreRetry.
	RetryAfter time.Duration
	// OpenTimeout bounds the restore engine's connection to the replicas,
	// and the wait for their addresses once the restore's turn came;
	// default 2 minutes.
	OpenTimeout time.Duration
	// MaxConcurrent is how many restores write and verify at once in the
	// manager (each holds the backup store's block buffers and an
	// engine); the others wait, their replicas running, in phase queued.
	// Default DefaultMaxRestores.
	MaxConcurrent int
}

// DefaultRestoreRetry is RestoreOptions.RetryAfter's default.
const DefaultRestoreRetry = time.Minute

// DefaultMaxRestores is RestoreOptions.MaxConcurrent's default: the
// manager's memory limit holds two restores beside two backup uploads.
const DefaultMaxRestores = 2

// restorePhase is where one restore run is.
type restorePhase int

const (
	// restoreChecking: reading the backup's manifest from the target.
	restoreChecking restorePhase = iota
	// restoreWaiting: the backup fits; waiting for the replicas' addresses.
	restoreWaiting
	// restoreQueued: the replicas run; waiting for one of the manager's
	// MaxConcurrent restore slots.
	restoreQueued
	// restoreWriting: writing the blocks through an engine in the manager.
	restoreWriting
	// restoreVerifying: reading every stored block back from every replica.
	restoreVerifying
	// restoreDone: ended, with err nil (complete) or not.
	restoreDone
)

// restoreRun is one attempt to restore a backup into a volume, run by a
// goroutine of the manager. The goroutine is the only writer of its
// fields (under mu); the reconciler reads them with view and hands it the
// replicas' addresses once, through addrs.
type restoreRun struct {
	src    v1.VolumeBackupSource
	cancel context.CancelFunc
	addrs  chan []string

	mu          sync.Mutex
	phase       restorePhase
	done, total int64
	err         error
	reason      string
	ended       time.Time
}

// restoreView is what the reconciler reads of a run.
type restoreView struct {
	phase       restorePhase
	done, total int64
	err         error
	reason      string
	ended       time.Time
}

func (run *restoreRun) view() restoreView {
	run.mu.Lock()
	defer run.mu.Unlock()
	return restoreView{phase: run.phase, done: run.done, total: run.total, err: run.err, reason: run.reason, ended: run.ended}
}

func (run *restoreRun) set(f func(run *restoreRun)) {
	run.mu.Lock()
	f(run)
	run.mu.Unlock()
}

// give hands the run the replicas' addresses, once; later calls do
// nothing.
func (run *restoreRun) give(addrs []string) {
	select {
	case run.addrs <- addrs:
	default:
	}
}

// restoreRuns are the manager's restore runs, by Volume UID. A manager
// that restarts has none: the next reconcile of a volume not yet restored
// starts its restore again from the beginning, which overwrites only
// ranges of a volume no one has used with the same backup's bytes.
type restoreRuns struct {
	mu   sync.Mutex
	runs map[types.UID]*restoreRun
	// slots holds one token per run writing or verifying; its capacity
	// is RestoreOptions.MaxConcurrent, set by the first start.
	slots chan struct{}
}

func (rs *restoreRuns) get(uid types.UID) *restoreRun {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.runs[uid]
}

// forget cancels and drops the volume's run, if any.
func (rs *restoreRuns) forget(uid types.UID) {
	rs.mu.Lock()
	run := rs.runs[uid]
	delete(rs.runs, uid)
	rs.mu.Unlock()
	if run != nil {
		run.cancel()
	}
}

// stopAll cancels every run: the manager stops (or lost its leadership),
// and the next leader starts them again.
func (rs *restoreRuns) stopAll() {
	rs.mu.Lock()
	runs := rs.runs
	rs.runs = nil
	rs.mu.Unlock()
	for _, run := range runs {
		run.cancel()
	}
}

// restoreJob is what a run needs to know of the volume and its target.
type restoreJob struct {
	store *backupstore.Store
	// target is the store's target, closed when the run ends.
	target backupstore.Target
	src    v1.VolumeBackupSource
	// volume, namespace, size and keyCheck are the new volume's ("" when
	// it is not encrypted).
	volume, namespace string
	size              int64
	keyCheck          string
	opts              RestoreOptions
	// slots are the manager's restore slots (restoreRuns.slots).
	slots chan struct{}
	log   logr.Logger
	// notify brings the volume back to its reconciler (progress, a phase
	// reached, the end).
	notify func()
}

// start starts a run of job for the volume uid.
func (rs *restoreRuns) start(uid types.UID, job restoreJob) *restoreRun {
	ctx, cancel := context.WithCancel(context.Background())
	run := &restoreRun{src: job.src, cancel: cancel, addrs: make(chan []string, 1)}
	rs.mu.Lock()
	if rs.runs == nil {
		rs.runs = map[types.UID]*restoreRun{}
	}
	if rs.slots == nil {
		rs.slots = make(chan struct{}, max(job.opts.MaxConcurrent, 1))
	}
	job.slots = rs.slots
	if old := rs.runs[uid]; old != nil {
		old.cancel()
	}
	rs.runs[uid] = run
	rs.mu.Unlock()
	go func() {
		defer backuptarget.CloseTarget(job.target) // last: after cancel stopped the run's calls
		defer cancel()
		reason, err := job.run(ctx, run)
		run.set(func(run *restoreRun) {
			run.phase, run.err, run.reason, run.ended = restoreDone, err, reason, time.Now()
		})
		if err != nil {
			job.log.Info("restore failed", "backup", job.src, "reason", reason, "error", err.Error())
		} else {
			job.log.Info("restore complete", "backup", job.src)
		}
		job.notify()
	}()
	return run
}

// run checks the backup, waits for the replicas and for a restore slot,
// then for the replicas' current addresses, writes the backup into them
// through an engine and verifies every replica. It returns the reason of condition Cloned for a failure.
func (job *restoreJob) run(ctx context.Context, run *restoreRun) (string, error) {
	m, reason, err := job.check(ctx)
	if err != nil {
		return reason, err
	}
	run.set(func(run *restoreRun) { run.phase, run.total = restoreWaiting, m.Size })
	job.notify()
	// Once the replicas run, the restore queues for a slot; the
	// addresses it writes to are taken again when its turn comes.
	select {
	case <-run.addrs:
	case <-ctx.Done():
		return v1.VolumeReasonRestoreFailed, ctx.Err()
	}
	run.set(func(run *restoreRun) { run.phase = restoreQueued })
	job.notify()
	select {
	case job.slots <- struct{}{}:
		defer func() { <-job.slots }()
	case <-ctx.Done():
		return v1.VolumeReasonRestoreFailed, ctx.Err()
	}
	// The wait for a slot may have been long, and a replica may have
	// moved meanwhile: take the addresses again, drop the ones handed
	// over before the turn came, and give up the slot if they do not
	// come soon.
	select {
	case <-run.addrs:
	default:
	}
	run.set(func(run *restoreRun) { run.phase = restoreWaiting })
	job.notify()
	var addrs []string
	select {
	case addrs = <-run.addrs:
	case <-time.After(job.opts.OpenTimeout):
		return v1.VolumeReasonRestoreFailed, fmt.Errorf("the volume's replicas did not all run within %s of the restore's turn", job.opts.OpenTimeout)
	case <-ctx.Done():
		return v1.VolumeReasonRestoreFailed, ctx.Err()
	}
	return job.write(ctx, run, m, addrs)
}

// check reads the backup's manifest and checks that it fits the volume:
// no bigger, and encrypted alike where the manifest records it. Nothing
// is written before it passes.
func (job *restoreJob) check(ctx context.Context) (*backupstore.Manifest, string, error) {
	m, err := job.store.Manifest(ctx, job.src.Volume, job.src.Name)
	switch {
	case errors.Is(err, backupstore.ErrBackupNotFound):
		return nil, v1.VolumeReasonBackupNotFound, fmt.Errorf("backup target %s holds no backup %s of volume %s: check spec.dataSource.backup (kubectl cairn backups, or cairn-data restore --list)",
			job.src.Target, job.src.Name, job.src.Volume)
	case errors.Is(err, backupstore.ErrCorrupt):
		return nil, v1.VolumeReasonBackupCorrupt, fmt.Errorf("the manifest of backup %s/%s on target %s is corrupt: %w", job.src.Volume, job.src.Name, job.src.Target, err)
	case err != nil:
		return nil, v1.VolumeReasonRestoreFailed, fmt.Errorf("reading backup %s/%s from target %s: %w", job.src.Volume, job.src.Name, job.src.Target, err)
	}
	if m.Size > job.size {
		return nil, v1.VolumeReasonBackupTooLarge, fmt.Errorf("backup %s/%s holds %d bytes, more than this volume's size %d: delete this volume and create it with a size of at least %d",
			job.src.Volume, job.src.Name, m.Size, job.size, m.Size)
	}
	if kc, ok := m.Labels[v1.BackupLabelKeyCheck]; ok && kc != job.keyCheck {
		return nil, v1.VolumeReasonBackupEncryptionMismatch, fmt.Errorf("backup %s/%s was taken of a volume %s, and this volume is %s: a backup holds the replicas' bytes as they were (ciphertext of an encrypted volume), so restore it into a volume encrypted with the same passphrase (the same spec.encryption.keyCheck), or not encrypted for a backup of a volume that was not",
			job.src.Volume, job.src.Name, describeKeyCheck(kc), describeKeyCheck(job.keyCheck))
	}
	return m, "", nil
}

func describeKeyCheck(kc string) string {
	if kc == "" {
		return "not encrypted"
	}
	return "encrypted with key check " + kc
}

// write opens an engine in the manager on the replicas (without a
// cipher: the backup's bytes, ciphertext or not, go to the replicas as
// they are), restores the backup through it, flushes, and verifies.
func (job *restoreJob) write(ctx context.Context, run *restoreRun, m *backupstore.Manifest, addrs []string) (string, error) {
	var key []byte
	if job.opts.Keys != nil {
		k, err := job.opts.Keys.VolumeKey(job.namespace, job.volume)
		if err != nil {
			return v1.VolumeReasonRestoreFailed, err
		}
		key = k
	}
	ropts := replicaclient.Options{Data: dataconn.ClientOptions{Key: key, TLS: job.opts.DataTLS, Logger: job.log}, ControlTLS: job.opts.ControlTLS}
	octx, cancel := context.WithTimeout(ctx, job.opts.OpenTimeout)
	e, err := engine.Open(octx, engine.Options{Name: job.volume, Size: job.size, Replicas: addrs, Dial: replicaclient.Dialer(ropts), Logger: job.log})
	cancel()
	if err != nil {
		return v1.VolumeReasonRestoreFailed, fmt.Errorf("connecting to the replicas: %s%w", connectHint(err, job.opts), err)
	}
	defer e.Close()
	verifyBytes := storedBytes(m) * int64(len(addrs))
	run.set(func(run *restoreRun) { run.phase, run.total = restoreWriting, m.Size+verifyBytes })
	throttle := newThrottle(job.notify)
	_, err = job.store.Restore(ctx, backupstore.RestoreOptions{Volume: job.src.Volume, Name: job.src.Name, Dest: engineDest{ctx: ctx, e: e},
		Progress: func(done, _ int64) { run.set(func(run *restoreRun) { run.done = done }); throttle() }})
	var be *backupstore.BlockError
	switch {
	case errors.As(err, &be) && (errors.Is(err, backupstore.ErrCorrupt) || errors.Is(err, backupstore.ErrNotFound)):
		return v1.VolumeReasonBackupCorrupt, fmt.Errorf("block at offset %d (object %s) of backup %s/%s on target %s is missing or fails its checksum (%w): the backup cannot be restored; restore another backup of the volume",
			be.Offset, be.Key, job.src.Volume, job.src.Name, job.src.Target, err)
	case errors.Is(err, backupstore.ErrBackupNotFound):
		return v1.VolumeReasonBackupNotFound, fmt.Errorf("backup %s/%s was deleted from target %s during the restore", job.src.Volume, job.src.Name, job.src.Target)
	case err != nil:
		return v1.VolumeReasonRestoreFailed, err
	}
	if err := e.Flush(ctx); err != nil {
		return v1.VolumeReasonRestoreFailed, fmt.Errorf("flushing the replicas: %w", err)
	}
	run.set(func(run *restoreRun) { run.phase, run.done = restoreVerifying, m.Size })
	job.notify()
	return job.verify(ctx, run, m, addrs, ropts, e.Epoch(), throttle)
}

// connectHint names the manager's own setting that a failed connection
// to the replicas points at, "" when none. The replicas' addresses are
// those they reported running, so their ports are open and a refusal is
// about the manager's credentials:
//   - a replica dials its data port first, then calls its control API; a
//     control API that requires mutual TLS closes a plain connection,
//     which gRPC reports as Unavailable (replicaclient.ErrNoControlAPI),
//     not as a TLS error, and refuses a client certificate not of its CA
//     (replicaclient.ErrControlTLS);
//   - a replica whose data port requires TLS (instance managers with
//     --data-tls) closes a plain connection at the key handshake, which
//     the client sees as a malformed handshake.
func connectHint(err error, opts RestoreOptions) string {
	switch {
	case errors.Is(err, replicaclient.ErrNoControlAPI) && opts.ControlTLS == nil:
		return "the replicas' data ports answered and their control APIs closed the manager's plain connection, as control APIs that require mutual TLS do: run the manager with --instance-manager-tls (Cairn's CA) when the instance managers run with --tls-client-ca; "
	case errors.Is(err, replicaclient.ErrNoControlAPI), errors.Is(err, replicaclient.ErrControlTLS):
		return "the replicas' data ports answered and their control APIs closed the manager's TLS connection, as they do when they do not accept its client certificate (Cairn's CA's: check the instance managers' --tls-client-ca file holds the bundle of the manager's serving Secret) or serve no TLS; "
	case errors.Is(err, dataconn.ErrAuthMalformed) && opts.DataTLS == nil:
		return "the replicas closed the plain data connection at the key handshake, as replicas whose data ports require TLS do: if the instance managers run with --data-tls, run the manager with --data-tls too; "
	}
	return ""
}

// verify reads every block the manifest lists back from each replica,
// over its own connection (not the engine's read path, which asks one of
// them) at the engine's epoch (replicas fence reads with it too), and
// compares its SHA-256 with the manifest's. Blocks the manifest leaves
// out were never written: a new replica reads zeros there.
func (job *restoreJob) verify(ctx context.Context, run *restoreRun, m *backupstore.Manifest, addrs []string, ropts replicaclient.Options, epoch uint64, progress func()) (string, error) {
	buf := make([]byte, m.BlockSize)
	for _, addr := range addrs {
		c, err := replicaclient.Dial(ctx, addr, ropts)
		if err != nil {
			return v1.VolumeReasonRestoreFailed, fmt.Errorf("verify: connecting to replica %s: %w", addr, err)
		}
		c.SetRequestEpoch(epoch)
		err = verifyReplica(ctx, c, m, buf, func(n int64) {
			run.set(func(run *restoreRun) { run.done += n })
			progress()
		})
		c.Close()
		if err != nil {
			return v1.VolumeReasonRestoreFailed, fmt.Errorf("verify: replica %s: %w", addr, err)
		}
	}
	return "", nil
}

func verifyReplica(ctx context.Context, c *replicaclient.Client, m *backupstore.Manifest, buf []byte, done func(int64)) error {
	for _, b := range m.Blocks {
		off := int64(b.Index) * m.BlockSize
		n := min(m.BlockSize, m.Size-off)
		if err := c.ReadAt(ctx, buf[:n], off); err != nil {
			return fmt.Errorf("read at %d: %w", off, err)
		}
		if sum := sha256.Sum256(buf[:n]); !bytes.Equal(sum[:], b.Hash[:]) {
			return fmt.Errorf("bytes %d..%d differ from the backup's block %s", off, off+n, b.Hash)
		}
		done(n)
	}
	return nil
}

// storedBytes is the bytes of the blocks a manifest lists.
func storedBytes(m *backupstore.Manifest) int64 {
	var n int64
	for _, b := range m.Blocks {
		off := int64(b.Index) * m.BlockSize
		n += min(m.BlockSize, m.Size-off)
	}
	return n
}

// engineDest writes a restore through the engine, the backup's bytes as
// they are.
type engineDest struct {
	ctx context.Context //nolint:containedctx // io.WriterAt has no context
	e   *engine.Engine
}

func (d engineDest) WriteAt(p []byte, off int64) (int, error) {
	if err := d.e.WriteAt(d.ctx, p, off, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// newThrottle returns a function that calls notify at most once a
// second (progress reports).
func newThrottle(notify func()) func() {
	var mu sync.Mutex
	var last time.Time
	return func() {
		mu.Lock()
		now := time.Now()
		due := now.Sub(last) >= time.Second
		if due {
			last = now
		}
		mu.Unlock()
		if due {
			notify()
		}
	}
}
