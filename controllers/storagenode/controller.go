// Package storagenode reconciles StorageNode objects: the disks of a node
// that replicas may be placed on. Capacity and free space come from the
// node's instance manager (NodeInfo reports its data directories), the
// space scheduled on each disk from the Replicas placed there.
package storagenode

import (
	"context"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/internal/objects"
	"github.com/cairn-io/cairn/controllers/scheduler"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// DefaultDiskName is the disk a StorageNode without spec.disks has: the
// instance manager's first data directory.
const DefaultDiskName = v1.DefaultDiskName

// Reconciler keeps StorageNode status current.
type Reconciler struct {
	client.Client
	Pool *imclient.Pool
	// Resync is how often free space is read again (it changes with every
	// write, and no event says so). Default 30s.
	Resync time.Duration
	// OverProvisioningPercent is the Volume reconciler's: a disk is
	// Schedulable only while scheduler.Usable says it has room under it.
	// 0: the scheduler's default.
	OverProvisioningPercent int
}

// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=storagenodes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=replicas;instancemanagers,verbs=get;list;watch

// Reconcile observes one node's disks and writes the status once.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	sn := &v1.StorageNode{}
	if err := r.Get(ctx, req.NamespacedName, sn); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	before := sn.DeepCopy()
	obs, err := r.observe(ctx, sn)
	if err != nil {
		return ctrl.Result{}, err
	}
	computeStatus(sn, obs, r.OverProvisioningPercent)
	if err := r.Status().Patch(ctx, sn, client.MergeFrom(before)); err != nil {
		return ctrl.Result{}, err
	}
	resync := r.Resync
	if resync <= 0 {
		resync = 30 * time.Second
	}
	return ctrl.Result{RequeueAfter: resync}, nil // free space drifts with use: a wait about time
}

// observed is what one reconcile learned of a node.
type observed struct {
	// imProblem says why the node's instance manager cannot report
	// (reason, message); empty when it did.
	imReason, imMessage string
	dataDirs            []*imv1.DataDir
	scheduled           map[string]int64 // disk name → bytes of replicas placed there
}

func (r *Reconciler) observe(ctx context.Context, sn *v1.StorageNode) (observed, error) {
	obs := observed{scheduled: map[string]int64{}}
	var replicas v1.ReplicaList
	if err := r.List(ctx, &replicas, client.InNamespace(sn.Namespace)); err != nil {
		return obs, err
	}
	for k, bytes := range scheduler.ScheduledBytes(replicas.Items) {
		if k.Node == sn.Spec.NodeName {
			obs.scheduled[k.Disk] = bytes
		}
	}
	var ims v1.InstanceManagerList
	if err := r.List(ctx, &ims, client.InNamespace(sn.Namespace)); err != nil {
		return obs, err
	}
	var im *v1.InstanceManager
	for i := range ims.Items {
		if ims.Items[i].Spec.NodeName == sn.Spec.NodeName && ims.Items[i].Spec.Address != "" {
			im = &ims.Items[i]
		}
	}
	if im == nil {
		obs.imReason, obs.imMessage = v1.ReasonNoInstanceManager, fmt.Sprintf("no InstanceManager with an address runs on node %s", sn.Spec.NodeName)
		return obs, nil
	}
	conn, err := r.Pool.Get(im.Spec.Address)
	if err != nil {
		obs.imReason, obs.imMessage = v1.ReasonInstanceManagerDown, err.Error()
		return obs, nil
	}
	ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ni, err := conn.Client.NodeInfo(ictx, &imv1.NodeInfoRequest{})
	if err != nil {
		obs.imReason, obs.imMessage = v1.ReasonInstanceManagerDown, fmt.Sprintf("instance manager %s at %s: %v", im.Name, im.Spec.Address, err)
		return obs, nil
	}
	obs.dataDirs = ni.GetDataDirs()
	return obs, nil
}

// Disks returns a node's disks: spec.disks, or the default disk at the
// first data directory when the spec lists none (dataDirs may be nil).
func Disks(sn *v1.StorageNode, firstDataDir string) []v1.DiskSpec {
	if len(sn.Spec.Disks) > 0 || firstDataDir == "" {
		return sn.Spec.Disks
	}
	return []v1.DiskSpec{{Name: DefaultDiskName, Path: firstDataDir}}
}

// computeStatus derives the status from what was observed. A disk is
// Schedulable when scheduler.Usable says it may take a replica (op is the
// over-provisioning percentage), the node when one of its disks is.
func computeStatus(sn *v1.StorageNode, obs observed, op int) {
	first := ""
	if len(obs.dataDirs) > 0 {
		first = obs.dataDirs[0].GetPath()
	}
	var disks []v1.DiskStatus
	schedulable := 0
	for _, d := range Disks(sn, first) {
		ds := diskStatus(sn, d, obs, op)
		if meta.IsStatusConditionTrue(ds.Conditions, v1.StorageNodeConditionSchedulable) {
			schedulable++
		}
		disks = append(disks, ds)
	}
	sn.Status.Disks = disks
	sn.Status.ObservedGeneration = sn.Generation
	set := func(typ string, ok bool, reason, msg string) {
		objects.SetCondition(&sn.Status.Conditions, sn.Generation, typ, ok, reason, msg)
	}
	if obs.imReason != "" {
		set(v1.ConditionReady, false, obs.imReason, obs.imMessage)
	} else {
		set(v1.ConditionReady, true, v1.ReasonAsExpected, fmt.Sprintf("the instance manager reports %d data directories", len(obs.dataDirs)))
	}
	switch {
	case schedulable > 0:
		set(v1.StorageNodeConditionSchedulable, true, v1.ReasonAsExpected, fmt.Sprintf("%d of %d disks take new replicas", schedulable, len(disks)))
	case sn.Spec.AllowScheduling != nil && !*sn.Spec.AllowScheduling:
		set(v1.StorageNodeConditionSchedulable, false, v1.StorageNodeReasonSchedulingDisabled, "spec.allowScheduling is false")
	default:
		set(v1.StorageNodeConditionSchedulable, false, v1.StorageNodeReasonNoSchedulableDisk, "no disk is ready, allowed and with room for a replica (see status.disks)")
	}
}

// diskStatus is one disk's status: what the instance manager reports of
// it, the bytes scheduled on it, and its Ready and Schedulable conditions
// (carried over from the last status, so unchanged ones keep their
// lastTransitionTime).
func diskStatus(sn *v1.StorageNode, d v1.DiskSpec, obs observed, op int) v1.DiskStatus {
	ds := v1.DiskStatus{Name: d.Name, Path: d.Path, Scheduled: qty(obs.scheduled[d.Name])}
	if old := findDisk(sn.Status.Disks, d.Name); old != nil {
		ds.Conditions = old.Conditions
	}
	cond := func(typ string, ok bool, reason, msg string) {
		objects.SetCondition(&ds.Conditions, sn.Generation, typ, ok, reason, msg)
	}
	sd := scheduler.FromSpec(sn, d)
	sd.Scheduled = obs.scheduled[d.Name]
	dd := findDataDir(obs.dataDirs, d.Path)
	switch {
	case obs.imReason != "":
		cond(v1.ConditionReady, false, obs.imReason, obs.imMessage)
	case dd == nil:
		cond(v1.ConditionReady, false, v1.StorageNodeReasonNotADataDirectory, fmt.Sprintf("%s is not a data directory of node %s's instance manager; add it with --data-dir", d.Path, sn.Spec.NodeName))
	default:
		ds.Filesystem, ds.Capacity, ds.Available = dd.GetFilesystem(), qty(dd.GetTotalBytes()), qty(dd.GetAvailableBytes())
		sd.Ready, sd.Capacity, sd.Available = true, dd.GetTotalBytes(), dd.GetAvailableBytes()
		cond(v1.ConditionReady, true, v1.ReasonAsExpected, fmt.Sprintf("%s (%s)", d.Path, dd.GetFilesystem()))
	}
	reason, msg := schedulableReason(&sd, op)
	cond(v1.StorageNodeConditionSchedulable, reason == v1.ReasonAsExpected, reason, msg)
	return ds
}

// schedulableReason turns scheduler.Usable's verdict on a disk into the
// reason and message of its Schedulable condition.
func schedulableReason(d *scheduler.Disk, op int) (reason, msg string) {
	switch scheduler.Usable(d, op) {
	case "":
		return v1.ReasonAsExpected, "new replicas may be placed here"
	case scheduler.RejectNotReady:
		return v1.StorageNodeReasonNoSchedulableDisk, "the disk is not ready"
	case scheduler.RejectNodeDisabled:
		return v1.StorageNodeReasonSchedulingDisabled, "allowScheduling is false on the node"
	case scheduler.RejectDiskDisabled:
		return v1.StorageNodeReasonSchedulingDisabled, "allowScheduling is false on the disk"
	default:
		return v1.StorageNodeReasonInsufficientStorage, fmt.Sprintf("no room for a new replica: %s scheduled of %s allowed ((capacity − storageReserved) × %d%%), %s free beyond the reserve",
			qty(d.Scheduled), qty(scheduler.Limit(d, op)), scheduler.OverProvisioning(op), qty(max(d.Available-d.Reserved, 0)))
	}
}

func qty(n int64) *resource.Quantity { return resource.NewQuantity(n, resource.BinarySI) }

func findDisk(ds []v1.DiskStatus, name string) *v1.DiskStatus {
	for i := range ds {
		if ds[i].Name == name {
			return &ds[i]
		}
	}
	return nil
}

func findDataDir(dirs []*imv1.DataDir, path string) *imv1.DataDir {
	for _, d := range dirs {
		if d.GetPath() == path {
			return d
		}
	}
	return nil
}

// SetupWithManager registers the reconciler: a StorageNode is reconciled
// when it changes, when a Replica is placed on (or leaves) its node, and
// when its node's InstanceManager changes.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	byNode := func(ctx context.Context, node string, namespace string) []reconcile.Request {
		return objects.OnNode(ctx, mgr.GetClient(), &v1.StorageNodeList{}, namespace, node, func(sn *v1.StorageNode) string { return sn.Spec.NodeName })
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1.StorageNode{}).
		Watches(&v1.Replica{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return byNode(ctx, o.(*v1.Replica).Spec.NodeName, o.GetNamespace())
		})).
		Watches(&v1.InstanceManager{}, handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
			return byNode(ctx, o.(*v1.InstanceManager).Spec.NodeName, o.GetNamespace())
		})).
		Named("storagenode").
		Complete(r)
}
