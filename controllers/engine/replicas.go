package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	grpcstatus "google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/internal/process"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// Engine event reasons.
const (
	EventReplicaAdded     = "ReplicaAdded"
	EventReplicaAddFailed = "ReplicaAddFailed"
	EventReplicaRemoved   = "ReplicaRemoved"
	EventExpanded         = "Expanded"
	EventExpandFailed     = "ExpandFailed"
	EventCloneStarted     = "CloneStarted"
	EventCloneFailed      = "CloneFailed"
)

// ReplicaAddress is the address an engine knows a replica by: DATA,CONTROL.
func ReplicaAddress(a v1.ReplicaAddress) string { return a.Data + "," + a.Control }

// applyWatchStatus copies what the engine's status stream reported into
// the Engine's status: each replica's mode and rebuild by the Replica name
// spec.replicaAddresses gives its address (members the spec no longer
// names are being removed and are left out), the snapshots, and the size.
func applyWatchStatus(e *v1.Engine, vs *enginev1.VolumeStatus) {
	names := map[string]string{}
	for n, a := range e.Spec.ReplicaAddresses {
		names[ReplicaAddress(a)] = n
	}
	st := &e.Status
	st.ReplicaModeMap = map[string]v1.ReplicaMode{}
	for _, r := range vs.GetReplicas() {
		if n, ok := names[r.GetAddress()]; ok {
			st.ReplicaModeMap[n] = v1.ReplicaMode(r.GetMode())
		}
	}
	// Rebuilds come ordered by address, then start: the last one of an
	// address is its latest.
	st.RebuildStatus = nil
	for _, rb := range vs.GetRebuilds() {
		n, ok := names[rb.GetReplica()]
		if !ok {
			continue
		}
		if st.RebuildStatus == nil {
			st.RebuildStatus = map[string]v1.RebuildStatus{}
		}
		out := v1.RebuildStatus{State: v1.RebuildState(rb.GetState()), SourceReplica: names[rb.GetSource()],
			BytesDone: rb.GetBytesDone(), BytesTotal: rb.GetBytesTotal(), DirtyOnly: rb.GetDirtyOnly(), Error: rb.GetError(),
			FullReason: v1.TruncateMessage(rb.GetFullReason(), maxFullReason), RelayReason: v1.TruncateMessage(rb.GetRelayReason(), maxFullReason)}
		if out.SourceReplica == "" {
			out.SourceReplica = rb.GetSource()
		}
		if out.BytesTotal > 0 {
			out.Progress = int32(min(100, out.BytesDone*100/out.BytesTotal))
		} else if out.State == v1.RebuildStateComplete {
			out.Progress = 100
		}
		if t := rb.GetStartedUnixNano(); t > 0 {
			out.StartedAt = &metav1.Time{Time: time.Unix(0, t)}
		}
		st.RebuildStatus[n] = out
	}
	st.Snapshots = nil
	for _, s := range vs.GetSnapshots() {
		if st.Snapshots == nil {
			st.Snapshots = map[string]v1.SnapshotInfo{}
		}
		info := v1.SnapshotInfo{Name: s.GetName(), Parent: s.GetParent(), UserCreated: s.GetUserCreated(),
			Size: resource.NewQuantity(s.GetDataBytes(), resource.BinarySI)}
		if t := s.GetCreatedUnixNano(); t > 0 {
			info.CreatedAt = &metav1.Time{Time: time.Unix(0, t)}
		}
		st.Snapshots[s.GetName()] = info
	}
	st.Size = resource.NewQuantity(vs.GetSize(), resource.BinarySI)
	if vs.ActualSize != nil { // else not sampled yet: keep the last known
		st.ActualSize = resource.NewQuantity(vs.GetActualSize(), resource.BinarySI)
	}
	st.Clone = nil
	if c := vs.GetClone(); c != nil {
		st.Clone = &v1.EngineCloneStatus{Address: c.GetSource(), Snapshot: c.GetSnapshot(), State: v1.RebuildState(c.GetState()),
			BytesDone: c.GetBytesDone(), BytesTotal: c.GetBytesTotal(), Error: c.GetError()}
		if c.GetBytesTotal() > 0 {
			st.Clone.Progress = int32(min(100, c.GetBytesDone()*100/c.GetBytesTotal()))
		}
	}
}

// needsClone reports whether the engine must be asked to copy
// spec.cloneFrom: only a maintenance engine copies (one with a device may
// have a user, whose data a copy would overwrite), and only when it has
// not copied that source, or its last copy of it failed.
func needsClone(e *v1.Engine, c *enginev1.Clone) bool {
	from := e.Spec.CloneFrom
	if from == nil || !e.Spec.Maintenance {
		return false
	}
	return c == nil || c.GetSource() != from.Address || c.GetSnapshot() != from.Snapshot || c.GetState() == string(v1.RebuildStateFailed)
}

// cloneRetryWait is how long after a failed copy it is tried again: a
// cause that lasts (the source replica gone) must not make a busy loop.
const cloneRetryWait = 5 * time.Second

// replicaChanges is what a running engine must do to serve exactly the
// replicas of spec.replicaAddresses: add the ones it lacks, or holds as
// ERR when givenBack says the Volume reconciler gave that failed replica
// back; remove the ones the spec dropped. A replica being rebuilt is left
// to its rebuild.
//
// An ERR member whose address the spec still names is not by itself a
// replica given back: the Volume reconciler may not have seen the failure
// yet, and a replica process restarted after a crash often gets the very
// ports it had (the instance manager hands out the lowest free ones).
// Adding it then would rebuild it before the failure was ever recorded
// (no failedAt, no ReplicaFailed event, no rebuild limit), and the spec's
// address might by then belong to another process.
func replicaChanges(spec map[string]v1.ReplicaAddress, vs *enginev1.VolumeStatus, givenBack func(name string) bool) (add, remove []string) {
	modes := map[string]string{}
	for _, r := range vs.GetReplicas() {
		modes[r.GetAddress()] = r.GetMode()
	}
	rebuilding := map[string]bool{}
	for _, rb := range vs.GetRebuilds() {
		if rb.GetState() == string(v1.RebuildStateInProgress) {
			rebuilding[rb.GetReplica()] = true
		}
	}
	want := map[string]bool{}
	for name, a := range spec {
		addr := ReplicaAddress(a)
		want[addr] = true
		m, ok := modes[addr]
		if (ok && m != string(v1.ReplicaModeERR)) || rebuilding[addr] || (ok && !givenBack(name)) {
			continue
		}
		add = append(add, addr)
	}
	for addr := range modes {
		if !want[addr] {
			remove = append(remove, addr)
		}
	}
	slices.Sort(add)
	slices.Sort(remove)
	return add, remove
}

// syncRunning brings a running engine to its spec: replicas added and
// removed through the engine's own rebuild (never a restart under the
// volume), and the volume expanded to spec.size. Each call is safe to
// repeat: the engine refuses to add a member it has and to remove one it
// lacks, and expanding to the current size does nothing. A faulted engine
// (no RW replica) is left as it is.
func (r *Reconciler) syncRunning(ctx context.Context, e *v1.Engine, c *Conn, vs *enginev1.VolumeStatus) error {
	if vs.GetRobustness() == string(v1.VolumeRobustnessFaulted) {
		// Nothing can be added to an engine without an RW replica to copy
		// from; the Volume reconciler salvages it (a restart, once every
		// replica that may hold the newest data runs).
		return nil
	}
	var errs []error
	back, err := r.givenBack(ctx, e)
	if err != nil {
		return err
	}
	add, remove := replicaChanges(e.Spec.ReplicaAddresses, vs, back)
	if len(add)+len(remove) > 0 {
		// The stream's status may predate our own last change (its next
		// sample comes later): decide from the engine's answer now, so an
		// add is not sent twice.
		if fresh, err := freshMembers(ctx, c); err == nil {
			add, remove = replicaChanges(e.Spec.ReplicaAddresses, fresh, back)
		}
	}
	for _, addr := range add {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		_, err := c.Client.ReplicaAdd(cctx, &enginev1.ReplicaAddRequest{Address: addr})
		cancel()
		if err != nil {
			objects.Event(r.Recorder, e, true, EventReplicaAddFailed, "AddReplica", "adding replica %s: %s", addr, grpcstatus.Convert(err).Message())
			errs = append(errs, fmt.Errorf("add replica %s: %w", addr, err))
			continue
		}
		objects.Event(r.Recorder, e, false, EventReplicaAdded, "AddReplica", "replica %s added write-only; rebuilding it", addr)
	}
	for _, addr := range remove {
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		_, err := c.Client.ReplicaRemove(cctx, &enginev1.ReplicaRemoveRequest{Address: addr})
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("remove replica %s: %w", addr, err))
			continue
		}
		objects.Event(r.Recorder, e, false, EventReplicaRemoved, "RemoveReplica", "replica %s removed from the engine", addr)
	}
	if cl := vs.GetClone(); needsClone(e, cl) && cl.GetState() == string(v1.RebuildStateFailed) &&
		time.Since(time.Unix(0, cl.GetFinishedUnixNano())) < cloneRetryWait {
		// The error requeues the Engine with the controller's back-off.
		errs = append(errs, fmt.Errorf("the copy from %s failed (%s); it is tried again shortly", cl.GetSource(), cl.GetError()))
	} else if needsClone(e, cl) {
		// A copy in progress or done from this source is never asked
		// again; the engine would not restart it anyway.
		from := e.Spec.CloneFrom
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		_, err := c.Client.CloneFrom(cctx, &enginev1.CloneFromRequest{Source: from.Address, Snapshot: from.Snapshot})
		cancel()
		if err != nil {
			objects.Event(r.Recorder, e, true, EventCloneFailed, "Clone", "copying snapshot %s from replica %s: %s", from.Snapshot, from.Replica, grpcstatus.Convert(err).Message())
			errs = append(errs, fmt.Errorf("clone from %s: %w", from.Address, err))
		} else {
			objects.Event(r.Recorder, e, false, EventCloneStarted, "Clone", "copying snapshot %s from replica %s (%s)", from.Snapshot, from.Replica, from.Address)
		}
	}
	if want := e.Spec.Size.Value(); want > vs.GetSize() {
		// Expansion can take a while on many replicas; it gets its own
		// longer deadline.
		cctx, cancel := context.WithTimeout(ctx, 4*callTimeout)
		_, err := c.Client.Expand(cctx, &enginev1.ExpandRequest{Size: want})
		cancel()
		if err != nil {
			objects.Event(r.Recorder, e, true, EventExpandFailed, "Expand", "expanding to %d bytes: %s", want, grpcstatus.Convert(err).Message())
			errs = append(errs, fmt.Errorf("expand to %d bytes: %w", want, err))
		} else {
			objects.Event(r.Recorder, e, false, EventExpanded, "Expand", "expanded from %d to %d bytes", vs.GetSize(), want)
		}
	}
	return errors.Join(errs...)
}

// givenBack reports, for each Replica the spec names, whether the Volume
// reconciler gave it back after a failure (replicaChanges): see
// replicaGivenBack.
func (r *Reconciler) givenBack(ctx context.Context, e *v1.Engine) (func(name string) bool, error) {
	back := map[string]bool{}
	for name, a := range e.Spec.ReplicaAddresses {
		rep := &v1.Replica{}
		if err := r.Get(ctx, client.ObjectKey{Namespace: e.Namespace, Name: name}, rep); err != nil {
			if apierrors.IsNotFound(err) {
				continue
			}
			return nil, err
		}
		back[name] = replicaGivenBack(rep, a)
	}
	return func(name string) bool { return back[name] }, nil
}

// replicaGivenBack: a replica the engine holds as ERR is added again only
// once the Volume reconciler has recorded its failure (spec.failedAt; it
// is cleared when the replica is RW again) and its process runs at the
// address the spec gives. The Volume reconciler keeps a failed replica in
// the spec only when it gives it back; until it has seen the failure the
// spec's entry is merely the old one.
func replicaGivenBack(rep *v1.Replica, a v1.ReplicaAddress) bool {
	return rep.Spec.FailedAt != nil && rep.DeletionTimestamp.IsZero() && rep.Status.InstanceState == v1.InstanceStateRunning &&
		rep.Status.ServesAt(a)
}

// freshMembers asks the engine for its replicas and rebuilds now.
func freshMembers(ctx context.Context, c *Conn) (*enginev1.VolumeStatus, error) {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	reps, err := c.Client.ReplicaList(cctx, &enginev1.ReplicaListRequest{})
	if err != nil {
		return nil, err
	}
	rbs, err := c.Client.RebuildStatus(cctx, &enginev1.RebuildStatusRequest{})
	if err != nil {
		return nil, err
	}
	return &enginev1.VolumeStatus{Replicas: reps.GetReplicas(), Rebuilds: rbs.GetRebuilds()}, nil
}

// staleReplicas names, in order, the replicas of spec.replicaAddresses
// that do not run at the address the spec gives, each with what is wrong
// (replicaMismatch). An engine is started only when there are none: an
// address copied into the spec earlier may by now belong to nothing (the
// replica's instance manager came back with a new pod IP) or to another
// process, and an engine started on it would wait for a replica that is
// not there. Where each replica runs is read from its node's instance
// manager (the process watch), the most current source there is: a
// Replica's status may not have caught up yet with an instance manager
// that just restarted.
func (r *Reconciler) staleReplicas(ctx context.Context, e *v1.Engine) ([]string, error) {
	names := make([]string, 0, len(e.Spec.ReplicaAddresses))
	for n := range e.Spec.ReplicaAddresses {
		names = append(names, n)
	}
	slices.Sort(names)
	var stale []string
	for _, n := range names {
		view, err := r.replicaView(ctx, e.Namespace, n)
		if err != nil {
			return nil, err
		}
		if why := replicaMismatch(e.Spec.ReplicaAddresses[n], view); why != "" {
			stale = append(stale, n+" ("+why+")")
		}
	}
	return stale, nil
}

// replicaSeen is what the control plane knows now of one replica: its
// object, and its process as its node's instance manager reports it.
type replicaSeen struct {
	rep *v1.Replica // nil: no such Replica
	// current: the node's instance manager was reached and its process
	// list is current; proc is the replica's process there (nil: none).
	current bool
	proc    *imv1.Process
	// why the instance manager could not be read ("" if it was).
	unreachable string
}

func (r *Reconciler) replicaView(ctx context.Context, namespace, name string) (replicaSeen, error) {
	rep := &v1.Replica{}
	if err := r.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, rep); err != nil {
		return replicaSeen{}, client.IgnoreNotFound(err)
	}
	out := replicaSeen{rep: rep}
	if rep.Spec.NodeName == "" {
		return out, nil
	}
	conn, im, err := r.Pool.ForNode(ctx, r.Client, namespace, rep.Spec.NodeName)
	switch {
	case errors.Is(err, imclient.ErrNoInstanceManager):
		out.unreachable = "no instance manager on node " + rep.Spec.NodeName
		return out, nil
	case err != nil:
		return replicaSeen{}, err
	}
	proc, ok, current := conn.Process(process.Name(rep))
	out.current = current
	if ok {
		out.proc = proc
	}
	if !current {
		out.unreachable = fmt.Sprintf("instance manager %s at %s is not reachable", im.Name, im.Spec.Address)
	}
	return out, nil
}

// replicaMismatch says why the replica seen cannot be reached at a, or ""
// when its process runs there.
func replicaMismatch(a v1.ReplicaAddress, s replicaSeen) string {
	switch {
	case s.rep == nil:
		return "no such Replica"
	case !s.rep.DeletionTimestamp.IsZero():
		return "being deleted"
	case s.rep.Spec.NodeName == "":
		return "not placed on a node"
	case s.unreachable != "":
		return s.unreachable
	case s.proc == nil:
		return "no process on node " + s.rep.Spec.NodeName
	case s.proc.GetState() != imv1.ProcessState_PROCESS_STATE_RUNNING:
		return "its process is " + string(process.StateFromProto(s.proc.GetState()))
	case s.proc.GetControlAddress() != a.Control || (a.Data != s.proc.GetDataAddress() && a.Data != s.proc.GetLocalDataAddress()):
		now := ReplicaAddress(v1.ReplicaAddress{Data: s.proc.GetDataAddress(), Control: s.proc.GetControlAddress()})
		return fmt.Sprintf("it runs at %s, the spec gives %s", now, ReplicaAddress(a))
	}
	return ""
}

// maxFullReason bounds RebuildStatus.fullReason and relayReason (their
// CRD limit).
const maxFullReason = 256
