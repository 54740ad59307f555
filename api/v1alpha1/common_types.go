package v1alpha1

// InstanceState is the observed state of a data-plane process (an engine or a
// replica) as its instance manager reports it. Engine and Replica share it.
// +kubebuilder:validation:Enum=stopped;starting;running;stopping;error;unknown
type InstanceState string

const (
	// InstanceStateStopped means no process exists for the instance.
	InstanceStateStopped InstanceState = "stopped"
	// InstanceStateStarting means the process was created and its ports do not answer yet.
	InstanceStateStarting InstanceState = "starting"
	// InstanceStateRunning means the process is up and its ports answer.
	InstanceStateRunning InstanceState = "running"
	// InstanceStateStopping means the process was asked to stop and has not exited yet.
	InstanceStateStopping InstanceState = "stopping"
	// InstanceStateError means the process exited on its own or failed to start.
	InstanceStateError InstanceState = "error"
	// InstanceStateUnknown means the instance manager that owns the process cannot be reached.
	InstanceStateUnknown InstanceState = "unknown"
)

// DesiredInstanceState is what a parent asks of an Engine or Replica process:
// a subset of InstanceState, the two states a caller can ask for.
// +kubebuilder:validation:Enum=stopped;running
type DesiredInstanceState string

const (
	// DesiredInstanceStateStopped asks for no process.
	DesiredInstanceStateStopped DesiredInstanceState = "stopped"
	// DesiredInstanceStateRunning asks for a running process.
	DesiredInstanceStateRunning DesiredInstanceState = "running"
)

// Frontend is how the engine exposes a volume as a block device on its node.
// +kubebuilder:validation:Enum=nbd;fuse
type Frontend string

const (
	// FrontendNBD serves the volume over NBD on a unix socket and, on nodes
	// with the nbd kernel module, connects it as /dev/nbdN.
	FrontendNBD Frontend = "nbd"
	// FrontendFUSE exposes the volume as one file in a FUSE mount attached to
	// a loop device (/dev/loopN). It needs only FUSE and loop in the kernel.
	FrontendFUSE Frontend = "fuse"
)

// ReplicaMode is the role the engine gives a replica.
// +kubebuilder:validation:Enum=RW;WO;ERR
type ReplicaMode string

const (
	// ReplicaModeRW replicas take writes and serve reads.
	ReplicaModeRW ReplicaMode = "RW"
	// ReplicaModeWO replicas take writes while they are being rebuilt, and
	// serve no reads until the rebuild completes and they become RW.
	ReplicaModeWO ReplicaMode = "WO"
	// ReplicaModeERR replicas failed an I/O or a rebuild. They are never read
	// again and never become RW without a fresh rebuild.
	ReplicaModeERR ReplicaMode = "ERR"
)

// Condition types shared by several kinds.
const (
	// ConditionReady is true when the object does what its spec asks: a
	// Volume serves I/O, an instance runs as desired, a node's disks can be used.
	ConditionReady = "Ready"
)

// Condition reasons shared by several kinds.
const (
	// ReasonInvalidSpec means the spec passed schema validation but cannot be
	// acted on (for example a data source that names a missing volume). The
	// condition message says what to change.
	ReasonInvalidSpec = "InvalidSpec"
	// ReasonEncryptionKeyUnusable means an encrypted volume's engine is
	// not started: its key Secret is missing or holds another passphrase
	// than the one the volume was created with. The message says which.
	ReasonEncryptionKeyUnusable = "EncryptionKeyUnusable"
	// ReasonReconciling means the object is moving towards its desired state.
	ReasonReconciling = "Reconciling"
	// ReasonAsExpected means the observed state matches the spec.
	ReasonAsExpected = "AsExpected"
)

// Ready condition reasons of an Engine or Replica, about its process on
// its node's instance manager.
const (
	// ReasonNoInstanceManager means no InstanceManager with an address
	// serves the process's node, so nothing can run there yet.
	ReasonNoInstanceManager = "NoInstanceManager"
	// ReasonInstanceManagerDown means the node's instance manager does not
	// answer: the process's state is unknown until it does.
	ReasonInstanceManagerDown = "InstanceManagerUnreachable"
	// ReasonProcessFailed means the process exited, or could not be
	// created; the message has the exit code and error. It is started again.
	ReasonProcessFailed = "ProcessFailed"
	// ReasonProcessBackOff means the process failed several times in a
	// row and its next start waits (an exponential back-off, capped); the
	// message has the last error, the number of failures and when it is
	// started again.
	ReasonProcessBackOff = "ProcessBackOff"
	// ReasonStarting means the process was created and has not reported
	// ready yet.
	ReasonStarting = "Starting"
	// ReasonStopped means desiredState is stopped, and so is the process.
	ReasonStopped = "Stopped"
	// ReasonWaitingForReplicas means an engine is not started yet: a
	// replica its spec names does not run, or runs at another address than
	// the spec gives (its instance manager restarted, say). The engine
	// starts once the spec names only running replicas at their current
	// addresses; the message names the ones it waits for.
	ReasonWaitingForReplicas = "WaitingForReplicas"
	// ReasonReplicasDeclaredLost (an Event on the Engine) means the engine
	// was started without replicas on nodes an operator declared shut
	// down (the out-of-service taint), although they may have been RW at
	// the volume's newest epoch: writes only they held, if any, are lost.
	ReasonReplicasDeclaredLost = "ReplicasDeclaredLost"
	// ReasonNodeOutOfService means the process's node carries the
	// out-of-service taint (node.kubernetes.io/out-of-service): an
	// operator declared it shut down, so nothing runs there and its
	// processes are not waited for.
	ReasonNodeOutOfService = "NodeOutOfService"
)

// Ready condition reasons of an Engine alone; those it shares with a
// Replica are above.
const (
	// EngineReasonNotPlaced means spec.nodeName is empty: the engine runs
	// nowhere (its volume is detached).
	EngineReasonNotPlaced = "NotPlaced"
	// EngineReasonNoReplicas means spec.replicaAddresses is empty: there
	// is nothing to serve the volume from.
	EngineReasonNoReplicas = "NoReplicas"
	// EngineReasonReplicaSyncFailed means the engine runs but bringing its
	// replica set to its spec failed; the message has the error. It is
	// retried.
	EngineReasonReplicaSyncFailed = "ReplicaSyncFailed"
)

// ReplicaReasonNotScheduled is the Ready reason of a Replica not yet
// placed on a disk (no node, disk path or data directory yet).
const ReplicaReasonNotScheduled = "NotScheduled"

// Ready condition reasons of an InstanceManager.
const (
	// InstanceManagerReasonNoAddress means spec.address is empty: the
	// node's instance-manager pod has no IP yet.
	InstanceManagerReasonNoAddress = "NoAddress"
	// InstanceManagerReasonUnreachable means the instance manager does not
	// answer at its address; the message has the error.
	InstanceManagerReasonUnreachable = "Unreachable"
)
