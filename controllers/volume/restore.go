package volume

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/display"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
	"github.com/cairn-io/cairn/dataplane/backupstore"
)

// +kubebuilder:rbac:groups=storage.cairn.io,resources=backuptargets,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=secrets;configmaps,verbs=get

// A volume restored from a backup (spec.dataSource.backup) is filled by
// the manager itself, which holds the target's credentials: an engine
// library instance in the manager, with no device, connects to the new
// volume's replicas (started for it, with no engine process) and writes
// the backup's blocks, each verified against the manifest's SHA-256 as
// it is read from the target, then every block is read back from every
// replica and compared again. Only then is the volume marked restored (the
// cloned annotation, as a clone), and only then may it attach. A restore
// that fails is tried again from the start after RestoreOptions.RetryAfter.

// restoreAnnotation is the cloned annotation's value of a restored
// volume: "backup:<target>/<volume>/<name>".
func restoreAnnotation(b *v1.VolumeBackupSource) string {
	return "backup:" + b.Target + "/" + b.Volume + "/" + b.Name
}

// planRestore works out a restore from spec.dataSource.backup while it is
// not done: the run in the manager that does it (started here), what it
// waits for, its progress and outcome. It sets s.clone and s.cloneReason
// for the status, and s.restoring while the replicas must run for it. It
// writes one thing: the cloned annotation once the run reports the backup
// written and verified on every replica.
func (r *Reconciler) planRestore(ctx context.Context, s *scope) error {
	v := s.v
	if v.Spec.DataSource == nil || v.Spec.DataSource.Backup == nil {
		return nil
	}
	src := v.Spec.DataSource.Backup
	if Cloned(v) {
		r.restores.forget(v.UID)
		s.clone, s.cloneReason = restoredStatus(v), v1.VolumeReasonRestoreCompleted
		return nil
	}
	st := &v1.CloneStatus{State: v1.CloneStatePending, Backup: src.DeepCopy()}
	s.clone, s.cloneReason = st, v1.VolumeReasonRestoreInProgress
	run := r.restores.get(v.UID)
	if run == nil {
		var err error
		if run, err = r.startRestore(ctx, s, st); err != nil || run == nil {
			return err
		}
	}
	return r.followRestore(ctx, s, st, run)
}

// startRestore starts the volume's run once its target can be reached; nil
// when it cannot (st and s.cloneReason say why, and the volume comes back
// after the retry wait).
func (r *Reconciler) startRestore(ctx context.Context, s *scope, st *v1.CloneStatus) (*restoreRun, error) {
	src := s.v.Spec.DataSource.Backup
	store, tg, msg, err := r.restoreStore(ctx, src.Target)
	if err != nil {
		return nil, err
	}
	if msg != "" {
		retry := r.restoreOpts().RetryAfter
		st.State, st.Message = v1.CloneStateFailed, fmt.Sprintf("%s (tried again in %s)", msg, retry.Round(time.Second))
		s.cloneReason = v1.VolumeReasonBackupTargetUnavailable
		s.requeueWithin(retry)
		return nil, nil
	}
	keyCheck := ""
	if e := s.v.Spec.Encryption; e != nil {
		keyCheck = e.KeyCheck
	}
	key := client.ObjectKeyFromObject(s.v)
	job := restoreJob{store: store, target: tg, src: *src, volume: s.v.Name, namespace: s.v.Namespace, size: s.v.Spec.Size.Value(), keyCheck: keyCheck,
		opts: r.restoreOpts(), log: logf.FromContext(ctx).WithName("restore"),
		notify: func() { r.notifyRestore(key) }}
	return r.restores.start(s.v.UID, job), nil
}

// restoreStore builds the backup store of the BackupTarget named target,
// S3 or NFS, and its target (which the restore closes when it ends: an
// NFS target holds connections); a message instead when it cannot (the
// target or its Secret missing).
func (r *Reconciler) restoreStore(ctx context.Context, target string) (*backupstore.Store, backupstore.Target, string, error) {
	rd := r.apiReader
	if rd == nil { // a Reconciler not set up with a manager (tests)
		rd = r.Client
	}
	bt := &v1.BackupTarget{}
	if err := rd.Get(ctx, client.ObjectKey{Name: target}, bt); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil, fmt.Sprintf("BackupTarget %s does not exist: create it (pointed at the bucket or export and prefix holding the backup), or fix spec.dataSource.backup.target", target), nil
		}
		return nil, nil, "", err
	}
	cfg, reason, msg, err := backuptarget.TargetConfig(ctx, rd, bt.Spec)
	if err != nil {
		return nil, nil, "", err
	}
	if reason != "" {
		return nil, nil, fmt.Sprintf("BackupTarget %s: %s (%s)", target, msg, reason), nil
	}
	opts := r.restoreOpts().Store
	opts.Log = logf.FromContext(ctx).WithName("backupstore")
	store, tg, err := cfg.OpenStore(opts)
	if err != nil {
		return nil, nil, fmt.Sprintf("BackupTarget %s: %v", target, err), nil
	}
	return store, tg, "", nil
}

// followRestore reports run in st and acts on it: hands it the replicas
// once they all run, records a completed restore in the cloned
// annotation, and drops a failed run once the retry wait is over.
func (r *Reconciler) followRestore(ctx context.Context, s *scope, st *v1.CloneStatus, run *restoreRun) error {
	src, rv := s.v.Spec.DataSource.Backup, run.view()
	what := fmt.Sprintf("backup %s/%s from target %s", src.Volume, src.Name, src.Target)
	st.BytesDone, st.BytesTotal = rv.done, rv.total
	if rv.total > 0 {
		st.Progress = int32(rv.done * 100 / rv.total)
	}
	switch rv.phase {
	case restoreChecking:
		st.Message = "reading the manifest of " + what
	case restoreWaiting:
		s.restoring = true
		st.Message = "starting the volume's replicas (without an engine) to restore " + what
		addrs, waiting := restoreAddresses(s)
		if waiting == "" {
			run.give(addrs)
		} else {
			st.Message += ": waiting for " + waiting
		}
	case restoreQueued:
		s.restoring = true
		st.Message = fmt.Sprintf("waiting to restore %s: %d restores run at once in the manager", what, r.restoreOpts().MaxConcurrent)
	case restoreWriting, restoreVerifying:
		s.restoring = true
		verb := "writing"
		if rv.phase == restoreVerifying {
			verb = "verifying every replica against"
		}
		st.State, st.Message = v1.CloneStateCopying, fmt.Sprintf("%s %s: %d%% (%s of %s)", verb, what, st.Progress, display.Bytes(rv.done), display.Bytes(rv.total))
	case restoreDone:
		if rv.err == nil {
			return r.recordRestored(ctx, s, st, what)
		}
		st.State, st.Message = v1.CloneStateFailed, rv.err.Error()
		s.cloneReason = rv.reason
		// The message names the time of the retry, not the time left, so
		// that it stays the same from one reconcile to the next (a changed
		// failure message is an Event).
		at := rv.ended.Add(r.restoreOpts().RetryAfter)
		st.Message += fmt.Sprintf(" (tried again at %s)", at.UTC().Format(time.TimeOnly))
		wait := at.Sub(s.now)
		if wait <= 0 {
			r.restores.forget(s.v.UID)
			wait = time.Millisecond // the next reconcile starts it again
		}
		s.requeueWithin(wait)
	}
	return nil
}

// recordRestored records a restore complete and verified: first in the
// Volume's cloned annotation (the fact: from then on nothing restores
// into the volume again, and it may attach), then in the status at the
// end of this reconcile. A crash before the annotation: the next manager
// restores again into replicas no user has written.
func (r *Reconciler) recordRestored(ctx context.Context, s *scope, st *v1.CloneStatus, what string) error {
	v := s.v
	before := v.DeepCopy()
	if v.Annotations == nil {
		v.Annotations = map[string]string{}
	}
	v.Annotations[volumes.AnnotationCloned] = restoreAnnotation(v.Spec.DataSource.Backup)
	if err := r.Patch(ctx, v, client.MergeFrom(before)); err != nil {
		return err
	}
	// The completed run stays until a reconcile reads the annotation
	// (planRestore forgets it then): a reconcile that still reads the
	// volume from before the patch finds it done and records it again,
	// instead of finding no run and starting a new restore.
	st.State, st.Progress, st.BytesDone = v1.CloneStateCompleted, 100, st.BytesTotal
	st.Message = "restored " + what + ": every block written and verified on every replica against the manifest's SHA-256"
	s.cloneReason = v1.VolumeReasonRestoreCompleted
	return nil
}

// restoredStatus is the status of a restore recorded as done: as last
// written, or from the annotation if the status was lost or is not
// written yet.
func restoredStatus(v *v1.Volume) *v1.CloneStatus {
	if c := v.Status.Clone; c != nil && c.State == v1.CloneStateCompleted {
		return c.DeepCopy()
	}
	b := v.Spec.DataSource.Backup
	st := &v1.CloneStatus{State: v1.CloneStateCompleted, Backup: b.DeepCopy(), Progress: 100,
		Message: fmt.Sprintf("restored backup %s/%s from target %s: every block written and verified on every replica against the manifest's SHA-256", b.Volume, b.Name, b.Target)}
	if c := v.Status.Clone; c != nil { // the last progress written (a reconcile that read the annotation before the status)
		st.BytesDone, st.BytesTotal = c.BytesTotal, c.BytesTotal
	}
	return st
}

// restoreAddresses are the replicas' addresses for the restore engine,
// once every wanted replica is placed and runs: the restore writes them
// all, so none needs a rebuild before the volume is used. Until then it
// returns what the restore waits for instead, for the status message.
func restoreAddresses(s *scope) ([]string, string) {
	var addrs, starting []string
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" || !rep.DeletionTimestamp.IsZero() {
			continue
		}
		a, ok := runningAddress(rep)
		if !ok {
			starting = append(starting, fmt.Sprintf("replica %s on node %s (%s)", rep.Name, rep.Spec.NodeName, instanceStateOrPending(rep.Status.InstanceState)))
			continue
		}
		addrs = append(addrs, a.Data+","+a.Control)
	}
	placed, want := len(addrs)+len(starting), wantReplicas(s.v)
	if len(starting) > 0 {
		sort.Strings(starting)
		return nil, strings.Join(starting, ", ")
	}
	if placed < want {
		return nil, fmt.Sprintf("%d of %d replicas to be placed on a node (condition Scheduled says why not)", want-placed, want)
	}
	sort.Strings(addrs)
	return addrs, ""
}

// instanceStateOrPending names a process state, "pending" before the
// instance manager reported any.
func instanceStateOrPending(st v1.InstanceState) string {
	if st == "" {
		return "pending"
	}
	return string(st)
}

// runRestoreReplicas is attachOrDetach while a restore needs the replicas:
// the engine stays stopped (the restore's engine runs in the manager) and
// every placed replica runs.
func (r *Reconciler) runRestoreReplicas(ctx context.Context, s *scope) error {
	e := s.engine
	if err := r.setEngine(ctx, e, func(e *v1.Engine) { e.Spec.DesiredState = v1.DesiredInstanceStateStopped }); err != nil {
		return err
	}
	if st := e.Status.InstanceState; st != "" && st != v1.InstanceStateStopped {
		return nil // the engine's status change brings us back
	}
	for _, rep := range s.replicas {
		if rep.Spec.NodeName == "" || !rep.DeletionTimestamp.IsZero() {
			continue
		}
		if err := r.setReplica(ctx, rep, v1.DesiredInstanceStateRunning); err != nil {
			return err
		}
	}
	return nil
}

// notifyRestore brings the volume back to the reconciler (through
// restoreEvents, a source of the controller). A controller that stopped
// reading (the manager stopping) does not hold the run's goroutine for
// longer than a minute.
func (r *Reconciler) notifyRestore(key client.ObjectKey) {
	ev := event.GenericEvent{Object: &v1.Volume{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}}
	select {
	case r.restoreEvents <- ev:
	case <-time.After(time.Minute):
	}
}

func (r *Reconciler) restoreOpts() RestoreOptions {
	o := r.Restore
	if o.RetryAfter <= 0 {
		o.RetryAfter = DefaultRestoreRetry
	}
	if o.OpenTimeout <= 0 {
		o.OpenTimeout = 2 * time.Minute
	}
	if o.MaxConcurrent <= 0 {
		o.MaxConcurrent = DefaultMaxRestores
	}
	return o
}
