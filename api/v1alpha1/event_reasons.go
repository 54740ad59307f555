package v1alpha1

// Reasons of the Events the manager records on the PersistentVolumeClaims
// (and pods) that use Cairn volumes, where users look (`kubectl describe
// pvc`, `kubectl describe pod`), so that a volume's trouble is seen without
// knowing Cairn's own objects.
const (
	// EventReasonVolumeDegraded (Warning, on the claim): the volume has
	// fewer RW replicas than it asks for. It keeps serving I/O; Cairn
	// rebuilds a replica.
	EventReasonVolumeDegraded = "VolumeDegraded"
	// EventReasonVolumeFaulted (Warning, on the claim and the pods using
	// it): no replica of the volume is usable; I/O stops until one is.
	EventReasonVolumeFaulted = "VolumeFaulted"
	// EventReasonVolumeHealthy (Normal, on the claim): a degraded or
	// faulted volume has every replica it asks for RW again.
	EventReasonVolumeHealthy = "VolumeHealthy"
	// EventReasonReplicaUnschedulable (Warning, on the claim): a replica of
	// the volume has no disk to go to (free space, anti-affinity, disk
	// tags); the message names the constraint.
	EventReasonReplicaUnschedulable = "ReplicaUnschedulable"
	// EventReasonAttachWaiting (Warning, on the claim and the pods on the
	// node using it): the volume was asked to attach to a node and is still
	// not attached there after a while; the message says what it waits for.
	EventReasonAttachWaiting = "VolumeAttachWaiting"
	// EventReasonSecretMissing (Warning, on a PersistentVolume of Cairn's
	// driver and its claim, or on a VolumeSnapshotContent of Cairn's
	// driver and its VolumeSnapshot): a Secret the object names (the CSI
	// secret parameters of its StorageClass or VolumeSnapshotClass) does
	// not exist. Kubernetes reads it before it attaches, detaches, deletes,
	// mounts or expands the volume, or deletes the snapshot, and waits
	// while it is missing; the message names the Secret and the command
	// that makes it again.
	EventReasonSecretMissing = "SecretMissing"
)
