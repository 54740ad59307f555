package engine

import (
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/process"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// trackDevice follows the block device the engine serves across its
// process's restarts (status.servedDevice) and records a loss
// (status.deviceLost) when a process that served a device on the engine's
// node stopped while the engine stayed wanted there, and the next one
// serves a fresh device instead of taking the old one over (the fuse
// frontend without a device keeper, a takeover that failed, an nbd device
// the kernel let go): filesystems mounted from the old device fail their
// I/O until their pods are restarted (controllers/workload). A restart
// that resumed the device (its users saw a pause) records nothing.
func trackDevice(e *v1.Engine, o process.Observation, now time.Time) {
	st := &e.Status
	if e.Spec.DesiredState != v1.DesiredInstanceStateRunning || e.Spec.NodeName == "" ||
		(st.ServedDevice != nil && st.ServedDevice.NodeName != e.Spec.NodeName) {
		st.ServedDevice = nil // detached or moved: a new device is expected
		return
	}
	if o.State != v1.InstanceStateRunning || o.Process == nil {
		// Unknown (the instance manager cannot be reached) says nothing
		// of the process: it may still serve the device.
		if st.ServedDevice != nil && o.State != v1.InstanceStateUnknown {
			st.ServedDevice.Interrupted = true
		}
		return
	}
	ep := o.Process.GetEndpoint()
	prev := st.ServedDevice
	if prev != nil && prev.Interrupted && !ep.GetResumed() {
		st.DeviceLost = &v1.DeviceLoss{At: metav1.NewTime(now), NodeName: prev.NodeName, Device: prev.Path, Message: fmt.Sprintf(
			"the engine process serving %s on node %s stopped, and the one started after it serves a fresh device (%s) instead of taking the old one over "+
				"(the fuse frontend without a device keeper, a takeover that failed, or an nbd device the kernel let go: see the engine's log)",
			prev.Path, prev.NodeName, ep.GetPath())}
	}
	switch ep.GetKind() {
	case imv1.EndpointKind_ENDPOINT_KIND_BLOCK_DEVICE, imv1.EndpointKind_ENDPOINT_KIND_LOOP_DEVICE:
		st.ServedDevice = &v1.ServedDevice{NodeName: e.Spec.NodeName, Path: ep.GetPath()}
	default:
		st.ServedDevice = nil // an NBD socket: its clients reconnect
	}
}
