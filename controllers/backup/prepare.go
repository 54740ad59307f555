package backup

import (
	"context"
	"fmt"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/internal/volumes"
)

// job is what one upload needs, gathered before it starts.
type job struct {
	key                  client.ObjectKey
	volume, name         string // the backup's folder and name on the target
	snapshot             string
	replica, replicaAddr string
	// replicaData is the replica's data address ("": the one it reports).
	replicaData          string
	volumeUID, backupUID string
	keyCheck             string // the volume's spec.encryption.keyCheck, "" when not encrypted
	target               backuptarget.Config
	// full is spec.mode full: no parent. maxIncremental is the target's
	// spec.maxIncrementalBackups (0: no bound).
	full           bool
	maxIncremental int
}

// snapshotName is the Snapshot a Backup reads: spec.snapshot, else the
// one the controller takes under the Backup's name.
func snapshotName(b *v1.Backup) string {
	if b.Spec.Snapshot != "" {
		return b.Spec.Snapshot
	}
	return b.Name
}

// prepare checks the Backup's inputs and waits for its snapshot and a
// replica to read it from. It returns the job to run, or nil with the
// status saying why not (and when to look again, if no watch brings the
// Backup back).
func (r *Reconciler) prepare(ctx context.Context, b *v1.Backup) (*job, ctrl.Result, error) {
	vol := &v1.Volume{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: b.Spec.Volume}, vol); err != nil {
		if apierrors.IsNotFound(err) {
			setState(b, v1.BackupStatePending, v1.BackupReasonVolumeNotFound, fmt.Sprintf(
				"volume %s does not exist in namespace %s: a Backup backs up an existing Volume; delete this Backup and create one naming an existing volume", b.Spec.Volume, b.Namespace))
			return nil, ctrl.Result{}, nil
		}
		return nil, ctrl.Result{}, err
	}
	cfg, maxIncremental, ok, res, err := r.target(ctx, b)
	if !ok || err != nil {
		return nil, res, err
	}
	snap, ok, err := r.snapshot(ctx, b, vol)
	if !ok || err != nil {
		return nil, ctrl.Result{}, err
	}
	name, addr, data, why, err := r.pickReplica(ctx, vol)
	if err != nil {
		return nil, ctrl.Result{}, err
	}
	if name == "" {
		setState(b, v1.BackupStatePending, v1.BackupReasonWaitingForReplica, why)
		return nil, ctrl.Result{}, nil // the Engine's changes bring us back
	}
	return &job{key: client.ObjectKeyFromObject(b), volume: vol.Name, name: b.Name, snapshot: snap,
		replica: name, replicaAddr: addr, replicaData: data, volumeUID: string(vol.UID), backupUID: string(b.UID), keyCheck: keyCheckOf(vol), target: cfg,
		full: b.Spec.Mode == v1.BackupModeFull, maxIncremental: maxIncremental}, ctrl.Result{}, nil
}

// target returns the store configuration and the incremental chain bound of
// the Backup's BackupTarget, if it is usable; otherwise the status says
// why (TargetNotFound or TargetUnavailable, with the fix).
func (r *Reconciler) target(ctx context.Context, b *v1.Backup) (backuptarget.Config, int, bool, ctrl.Result, error) {
	bt := &v1.BackupTarget{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: b.Spec.Target}, bt); err != nil {
		if apierrors.IsNotFound(err) {
			setState(b, v1.BackupStatePending, v1.BackupReasonTargetNotFound, fmt.Sprintf(
				"BackupTarget %s does not exist: create it (kubectl get backuptargets lists those that do), or delete this Backup and create one naming an existing target", b.Spec.Target))
			return backuptarget.Config{}, 0, false, ctrl.Result{}, nil
		}
		return backuptarget.Config{}, 0, false, ctrl.Result{}, err
	}
	unavailable := func(format string, args ...any) (backuptarget.Config, int, bool, ctrl.Result, error) {
		setState(b, v1.BackupStatePending, v1.BackupReasonTargetUnavailable, fmt.Sprintf(format, args...))
		return backuptarget.Config{}, 0, false, ctrl.Result{}, nil
	}
	c := meta.FindStatusCondition(bt.Status.Conditions, v1.BackupTargetConditionAvailable)
	switch {
	case c == nil:
		return unavailable("waiting for BackupTarget %s's first check", bt.Name)
	case c.Status != metav1.ConditionTrue:
		return unavailable("BackupTarget %s is not available (%s): %s; fix the target (kubectl describe backuptarget %s), the backup starts once its check passes", bt.Name, c.Reason, c.Message, bt.Name)
	}
	cfg, reason, msg, err := backuptarget.TargetConfig(ctx, r.Reader, bt.Spec)
	if err != nil {
		return cfg, 0, false, ctrl.Result{}, err
	}
	if reason != "" {
		// Secrets are not watched: look again soon.
		_, _, ok, _, _ := unavailable("BackupTarget %s: %s (%s)", bt.Name, msg, reason)
		return cfg, 0, ok, ctrl.Result{RequeueAfter: waitRequeue}, nil
	}
	return cfg, int(bt.Spec.MaxIncrementalBackups), true, ctrl.Result{}, nil
}

// snapshot returns the name of the Backup's Snapshot once it is ready,
// taking it first (named after the Backup, owned by it) when spec.snapshot
// is empty.
func (r *Reconciler) snapshot(ctx context.Context, b *v1.Backup, vol *v1.Volume) (string, bool, error) {
	name := snapshotName(b)
	s := &v1.Snapshot{}
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: b.Namespace, Name: name}, s)
	switch {
	case apierrors.IsNotFound(err) && b.Spec.Snapshot != "":
		setState(b, v1.BackupStatePending, v1.BackupReasonSnapshotInvalid, fmt.Sprintf(
			"Snapshot %s does not exist in namespace %s: name an existing Snapshot of volume %s, or leave spec.snapshot empty and the backup takes one", name, b.Namespace, vol.Name))
		return "", false, nil
	case apierrors.IsNotFound(err):
		// If we crash after creating it, the next reconcile finds it by
		// name; it is owned by the Backup, so deleting the Backup deletes it.
		s = &v1.Snapshot{ObjectMeta: metav1.ObjectMeta{Namespace: b.Namespace, Name: name}, Spec: v1.SnapshotSpec{Volume: vol.Name}}
		if err := controllerutil.SetControllerReference(b, s, r.Client.Scheme()); err != nil {
			return "", false, err
		}
		if err := r.Client.Create(ctx, s); err != nil && !apierrors.IsAlreadyExists(err) {
			return "", false, err
		}
		setState(b, v1.BackupStatePending, v1.BackupReasonPending, fmt.Sprintf("taking snapshot %s of volume %s", name, vol.Name))
		return "", false, nil
	case err != nil:
		return "", false, err
	}
	if s.Spec.Volume != vol.Name {
		setState(b, v1.BackupStatePending, v1.BackupReasonSnapshotInvalid, fmt.Sprintf(
			"Snapshot %s is of volume %s, not %s: name a Snapshot of volume %s (a Snapshot the backup takes itself is named after the Backup, so a Snapshot of that name must not exist)", name, s.Spec.Volume, vol.Name, vol.Name))
		return "", false, nil
	}
	if !s.Status.ReadyToUse {
		msg := fmt.Sprintf("waiting for snapshot %s of volume %s", name, vol.Name)
		if c := meta.FindStatusCondition(s.Status.Conditions, v1.SnapshotConditionReady); c != nil {
			msg += ": " + c.Message
		}
		setState(b, v1.BackupStatePending, v1.BackupReasonPending, msg)
		return "", false, nil
	}
	return name, true, nil
}

// pickReplica names a replica of the volume to read the snapshot from:
// one the volume's engine holds RW (it has every acknowledged write and
// every snapshot), whose process runs and reports its control address.
// It reads from whichever such replica there is, so a restarted instance
// manager or a lost node only changes which one.
func (r *Reconciler) pickReplica(ctx context.Context, vol *v1.Volume) (name, addr, data, why string, err error) {
	e := &v1.Engine{}
	if err := r.Client.Get(ctx, client.ObjectKey{Namespace: vol.Namespace, Name: volumes.EngineName(vol)}, e); err != nil {
		if apierrors.IsNotFound(err) {
			return "", "", "", fmt.Sprintf("waiting for volume %s's engine: the backup reads from a replica the engine holds RW", vol.Name), nil
		}
		return "", "", "", "", err
	}
	var rw []string
	for n, m := range e.Status.ReplicaModeMap {
		if m == v1.ReplicaModeRW {
			rw = append(rw, n)
		}
	}
	slices.Sort(rw)
	for _, n := range rw {
		rep := &v1.Replica{}
		if err := r.Client.Get(ctx, client.ObjectKey{Namespace: vol.Namespace, Name: n}, rep); err != nil {
			if apierrors.IsNotFound(err) {
				continue
			}
			return "", "", "", "", err
		}
		if rep.Status.InstanceState == v1.InstanceStateRunning && rep.Status.ControlAddress != "" && rep.DeletionTimestamp.IsZero() {
			return n, rep.Status.ControlAddress, rep.Status.Address, "", nil
		}
	}
	return "", "", "", fmt.Sprintf("waiting for a running replica of volume %s that its engine holds RW (it holds %v RW); for a detached volume they are started for the backup", vol.Name, rw), nil
}

func setState(b *v1.Backup, st v1.BackupState, reason, msg string) {
	b.Status.State = st
	b.Status.Message = msg
	meta.SetStatusCondition(&b.Status.Conditions, metav1.Condition{Type: v1.BackupConditionCompleted,
		Status: conditionStatus(st == v1.BackupStateCompleted), Reason: reason, Message: msg, ObservedGeneration: b.Generation})
}

func conditionStatus(ok bool) metav1.ConditionStatus {
	if ok {
		return metav1.ConditionTrue
	}
	return metav1.ConditionFalse
}

func metavTime() *metav1.Time { return &metav1.Time{Time: time.Now()} }

// keyCheckOf is what a backup's manifest records of the volume's
// encryption (label v1.BackupLabelKeyCheck), so a restore can refuse a
// volume whose key would not read it: the key check, or "" when the volume
// is not encrypted.
func keyCheckOf(vol *v1.Volume) string {
	if vol.Spec.Encryption == nil {
		return ""
	}
	return vol.Spec.Encryption.KeyCheck
}
