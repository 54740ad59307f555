package backup

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/resource"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/dataplane/backupstore"
	"github.com/cairn-io/cairn/dataplane/snapshotsource"
)

// Errors an upload ends with that decide the Backup's reason.
var (
	// errStalled: no progress for StallTimeout; the upload was cancelled.
	errStalled = errors.New("no progress")
	// errNameConflict: the target holds a backup of this name written by
	// another Backup object.
	errNameConflict = errors.New("backup name taken on the target")
)

// openStore opens the backup store on a target; close returns what
// the target holds (an NFS target's connections).
func (r *Reconciler) openStore(cfg backuptarget.Config) (store *backupstore.Store, close func(), err error) {
	opts := r.StoreOptions
	opts.Log = r.Log
	store, tg, err := cfg.OpenStore(opts)
	if err != nil {
		return nil, nil, err
	}
	return store, func() { backuptarget.CloseTarget(tg) }, nil
}

// upload runs one attempt of j: it finds a backup of this Backup already
// on the target (an earlier attempt wrote its manifest and the manager
// stopped before recording it), or picks the parent and uploads.
func (r *Reconciler) upload(ctx context.Context, j *job) (*backupstore.BackupResult, error) {
	log := r.Log.WithValues("backup", j.key, "snapshot", j.snapshot, "replica", j.replica)
	store, closeStore, err := r.openStore(j.target)
	if err != nil {
		return nil, err
	}
	defer closeStore()
	if res, err := r.existing(ctx, store, j); res != nil || err != nil {
		return res, err
	}
	rc, err := snapshotsource.Dial(j.replicaAddr, r.dialOptions()...)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	rc.DataPort = r.dataPort(j, log)
	opts := snapshotsource.BackupOptions{Volume: j.volume, Name: j.name, Snapshot: j.snapshot,
		Labels: map[string]string{LabelVolumeUID: j.volumeUID, LabelBackupUID: j.backupUID, LabelBackup: j.key.String(), v1.BackupLabelKeyCheck: j.keyCheck}}
	if opts.BaseSnapshot, opts.BaseBackup, err = r.parent(ctx, store, rc, j); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	w := r.watch(ctx, cancel, j, opts.BaseBackup)
	defer w.stop()
	opts.Progress = w.progress
	rc.OnReply = w.touch
	log.Info("backup upload starting", "parent", opts.BaseBackup)
	res, err := snapshotsource.Backup(ctx, store, rc, opts)
	if inUse, why := rc.DataPortInUse(); inUse {
		log.Info("backup upload ended", "read", "over the data port")
	} else if why != nil {
		log.Info("backup upload ended", "read", "over the control API: the data port did not serve it", "reason", why.Error())
	}
	if err != nil && errors.Is(context.Cause(ctx), errStalled) {
		err = fmt.Errorf("%w for %v: %w", errStalled, r.stallTimeout(), err)
	}
	return res, err
}

// dataPort is how the upload reaches the replica's data port: with the
// volume's key and the data ports' TLS, as the volume's engine. Nil (the
// control API only) when the key cannot be had: the control API needs
// none.
func (r *Reconciler) dataPort(j *job, log logr.Logger) *snapshotsource.DataPort {
	var key []byte
	if r.Keys != nil {
		k, err := r.Keys.VolumeKey(j.key.Namespace, j.volume)
		if err != nil {
			log.Info("the snapshot is read over the replica's control API: no data-connection key for the volume", "reason", err.Error())
			return nil
		}
		key = k
	}
	return &snapshotsource.DataPort{Address: j.replicaData, Key: key, TLS: r.DataTLS, Logger: log}
}

// existing returns the result of a backup of this name already on the
// target, if this Backup wrote it; another Backup's is errNameConflict.
func (r *Reconciler) existing(ctx context.Context, store *backupstore.Store, j *job) (*backupstore.BackupResult, error) {
	m, err := store.Manifest(ctx, j.volume, j.name)
	if errors.Is(err, backupstore.ErrBackupNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if m.Labels[LabelBackupUID] != j.backupUID {
		return nil, fmt.Errorf("%w: volume %s's backup %s on the target was written by %q", errNameConflict, j.volume, j.name, m.Labels[LabelBackup])
	}
	return &backupstore.BackupResult{ReadBytes: m.ReadBytes, Info: backupstore.BackupInfo{Name: m.Name, Parent: m.Parent, Size: m.Size,
		BlockSize: m.BlockSize, Blocks: int64(len(m.Blocks)), NewBlocks: m.NewBlocks, NewBytes: m.NewBytes, Created: m.Created, Labels: m.Labels}}, nil
}

// parent picks the newest backup of the same Volume object on the target
// whose snapshot the replica still holds (of the newest maxParentProbes):
// this backup is incremental to it. None, spec.mode full, or a parent
// that already ends j.maxIncremental incremental backups in a row: a full
// backup.
func (r *Reconciler) parent(ctx context.Context, store *backupstore.Store, rc *snapshotsource.Client, j *job) (baseSnap, baseBackup string, err error) {
	if j.full {
		return "", "", nil
	}
	list, err := store.List(ctx, j.volume)
	if err != nil {
		return "", "", err
	}
	slices.SortFunc(list, func(a, b backupstore.BackupInfo) int { return b.Created.Compare(a.Created) })
	probes := 0
	for _, in := range list {
		snap := in.Labels[snapshotsource.SnapshotLabel]
		if in.Labels[LabelVolumeUID] != j.volumeUID || in.Name == j.name || snap == "" || snap == j.snapshot {
			continue
		}
		if probes++; probes > maxParentProbes {
			break
		}
		ok, err := rc.HasSnapshot(ctx, snap)
		if err != nil {
			return "", "", err
		}
		if !ok {
			continue
		}
		if j.maxIncremental > 0 && incrementalRun(list, in) >= j.maxIncremental {
			return "", "", nil
		}
		return snap, in.Name, nil
	}
	return "", "", nil
}

// incrementalRun counts the incremental backups in a row that end with
// b: b, its parent, and so on back to the first full backup (or to a
// parent no longer listed, which ends the run).
func incrementalRun(list []backupstore.BackupInfo, b backupstore.BackupInfo) int {
	byName := make(map[string]backupstore.BackupInfo, len(list))
	for _, in := range list {
		byName[in.Name] = in
	}
	n := 0
	for b.Parent != "" && n <= len(list) {
		n++
		p, ok := byName[b.Parent]
		if !ok {
			break
		}
		b = p
	}
	return n
}

// maxParentProbes bounds how many earlier backups' snapshots are looked
// for on the replica: past the newest few, a full backup is cheaper to
// reason about than a parent many snapshots back.
const maxParentProbes = 8

// watcher patches an upload's progress into the Backup at most every
// ProgressInterval and cancels the upload when it reads nothing for
// StallTimeout.
type watcher struct {
	r      *Reconciler
	j      *job
	parent string

	mu          sync.Mutex
	done, total int64
	last        time.Time // last progress (or start)
	sent        int64     // done as last patched, -1 before the first
	stopCh      chan struct{}
	ended       chan struct{}
}

func (r *Reconciler) watch(ctx context.Context, cancel context.CancelCauseFunc, j *job, parent string) *watcher {
	w := &watcher{r: r, j: j, parent: parent, last: time.Now(), sent: -1, stopCh: make(chan struct{}), ended: make(chan struct{})}
	go w.loop(ctx, cancel)
	return w
}

func (w *watcher) progress(done, total int64) {
	w.mu.Lock()
	w.done, w.total, w.last = done, total, time.Now()
	w.mu.Unlock()
	if w.r.onProgress != nil {
		w.r.onProgress(w.j.key, done, total)
	}
}

// touch records that the replica answered a call (the change map's
// pages come before any data is read).
func (w *watcher) touch() {
	w.mu.Lock()
	w.last = time.Now()
	w.mu.Unlock()
}

func (w *watcher) stop() { close(w.stopCh); <-w.ended }

func (w *watcher) loop(ctx context.Context, cancel context.CancelCauseFunc) {
	defer close(w.ended)
	tick := time.NewTicker(min(w.r.progressInterval(), w.r.stallTimeout()/4))
	defer tick.Stop()
	var lastPatch time.Time
	for {
		select {
		case <-w.stopCh:
			return
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		w.mu.Lock()
		done, total, idle := w.done, w.total, time.Since(w.last)
		w.mu.Unlock()
		if idle > w.r.stallTimeout() {
			w.r.Log.Info("backup upload stalled; cancelling it", "backup", w.j.key, "idle", idle.String())
			cancel(errStalled)
			return
		}
		if done != w.sent && time.Since(lastPatch) >= w.r.progressInterval() {
			if err := w.patch(ctx, done, total); err == nil {
				w.sent, lastPatch = done, time.Now()
			}
		}
	}
}

// patch writes bytesDone, bytesTotal, progress and parent: only those
// fields, so it does not undo what Reconcile writes.
func (w *watcher) patch(ctx context.Context, done, total int64) error {
	b := &v1.Backup{}
	if err := w.r.Client.Get(ctx, w.j.key, b); err != nil {
		return err
	}
	if b.Status.State != v1.BackupStateInProgress {
		return nil
	}
	before := b.DeepCopy()
	b.Status.BytesDone, b.Status.BytesTotal, b.Status.Progress = done, total, percent(done, total)
	b.Status.Parent = w.parent
	return client.IgnoreNotFound(w.r.Client.Status().Patch(ctx, b, client.MergeFrom(before)))
}

func percent(done, total int64) int32 {
	if total <= 0 {
		return 100
	}
	return int32(done * 100 / total)
}

// recordOutcome writes an ended upload's result into b.
func (r *Reconciler) recordOutcome(b *v1.Backup, res *backupstore.BackupResult, err error) ctrl.Result {
	if err == nil {
		in := res.Info
		b.Status.BackupName, b.Status.Parent = in.Name, in.Parent
		b.Status.VolumeSize = resource.NewQuantity(in.Size, resource.BinarySI)
		b.Status.UploadedBytes = in.NewBytes
		// Found on the target, written by an earlier attempt: the manifest
		// says what that attempt read (zero in manifests from before it
		// did, which leaves what this attempt's status held).
		if res.ReadBytes > 0 {
			b.Status.BytesTotal = res.ReadBytes
		}
		b.Status.BytesDone, b.Status.Progress = b.Status.BytesTotal, 100
		b.Status.CompletionTime = metavTime()
		setState(b, v1.BackupStateCompleted, v1.BackupReasonCompleted, fmt.Sprintf(
			"backup %s of volume %s is on target %s: %d blocks, %d bytes uploaded (parent %q)", in.Name, b.Spec.Volume, b.Spec.Target, in.Blocks, in.NewBytes, in.Parent))
		r.Log.Info("backup completed", "backup", client.ObjectKeyFromObject(b), "parent", in.Parent, "uploadedBytes", in.NewBytes)
		objects.Event(r.Recorder, b, false, EventCompleted, "Backup", "%s", b.Status.Message)
		return ctrl.Result{}
	}
	b.Status.LastFailureTime = metavTime()
	reason := v1.BackupReasonFailed
	wait := r.backoff(b.Status.Attempts)
	msg := fmt.Sprintf("attempt %d failed, retried in %v: %v", b.Status.Attempts, wait, err)
	switch {
	case errors.Is(err, errStalled):
		reason = v1.BackupReasonStalled
	case errors.Is(err, errNameConflict):
		// Retrying cannot help: the status stays failed until the Backup
		// is deleted and re-created under another name.
		reason, wait = v1.BackupReasonNameConflict, 0
		msg = fmt.Sprintf("%v: delete this Backup and create one under another name", err)
	}
	setState(b, v1.BackupStateFailed, reason, msg)
	r.Log.Info("backup attempt failed", "backup", client.ObjectKeyFromObject(b), "reason", reason, "error", err.Error())
	objects.Event(r.Recorder, b, true, EventFailed, "Backup", "%s: %s", reason, msg)
	return ctrl.Result{RequeueAfter: wait}
}

func (r *Reconciler) stallTimeout() time.Duration {
	if r.StallTimeout > 0 {
		return r.StallTimeout
	}
	return DefaultStallTimeout
}

func (r *Reconciler) progressInterval() time.Duration {
	if r.ProgressInterval > 0 {
		return r.ProgressInterval
	}
	return DefaultProgressInterval
}
