package engine

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/internal/imtest"
	"github.com/cairn-io/cairn/controllers/internal/process"
	imv1 "github.com/cairn-io/cairn/dataplane/api/instancemanager/v1"
)

// TestTrackDevice walks the decision: a device is lost only when a
// process that served it stopped (seen stopped, not merely unreachable)
// while the engine stayed wanted on its node, and the next one did not
// resume it.
func TestTrackDevice(t *testing.T) {
	now := time.Unix(1000, 0)
	running := func(path string, resumed bool) process.Observation {
		return process.Observation{State: v1.InstanceStateRunning, Process: &imv1.Process{State: imv1.ProcessState_PROCESS_STATE_RUNNING,
			Endpoint: &imv1.Endpoint{Path: path, Kind: imv1.EndpointKind_ENDPOINT_KIND_LOOP_DEVICE, Resumed: resumed}}}
	}
	socket := process.Observation{State: v1.InstanceStateRunning, Process: &imv1.Process{
		Endpoint: &imv1.Endpoint{Path: "/run/e.sock", Kind: imv1.EndpointKind_ENDPOINT_KIND_NBD_SOCKET}}}
	state := func(s v1.InstanceState) process.Observation { return process.Observation{State: s} }
	for _, tc := range []struct {
		name  string
		steps []process.Observation
		move  bool // the engine is moved to another node before the last step
		stop  bool // the engine is stopped before the last step
		lost  string
	}{
		{"first start", []process.Observation{state(v1.InstanceStateStarting), running("/dev/loop1", false)}, false, false, ""},
		{"restarted on a fresh device", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateStopped), running("/dev/loop2", false)}, false, false, "/dev/loop1"},
		{"restart that resumed", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateError), running("/dev/loop1", true)}, false, false, ""},
		{"unreachable, then the same process", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateUnknown), running("/dev/loop1", false)}, false, false, ""},
		{"the same device number, not resumed", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateStarting), running("/dev/loop1", false)}, false, false, "/dev/loop1"},
		{"moved to another node", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateStopped), running("/dev/loop2", false)}, true, false, ""},
		{"detached and attached", []process.Observation{running("/dev/loop1", false), state(v1.InstanceStateStopped), running("/dev/loop2", false)}, false, true, ""},
		{"an NBD socket has no device to lose", []process.Observation{socket, state(v1.InstanceStateStopped), socket}, false, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &v1.Engine{Spec: v1.EngineSpec{NodeName: "a", DesiredState: v1.DesiredInstanceStateRunning}}
			for i, o := range tc.steps {
				if i == len(tc.steps)-1 {
					if tc.move {
						e.Spec.NodeName = "b"
					}
					if tc.stop {
						e.Spec.DesiredState = v1.DesiredInstanceStateStopped
						trackDevice(e, state(v1.InstanceStateStopped), now)
						e.Spec.DesiredState = v1.DesiredInstanceStateRunning
					}
				}
				trackDevice(e, o, now)
			}
			got := ""
			if e.Status.DeviceLost != nil {
				got = e.Status.DeviceLost.Device
				if e.Status.DeviceLost.NodeName != "a" || !e.Status.DeviceLost.At.Time.Equal(now) || e.Status.DeviceLost.Message == "" {
					t.Fatalf("deviceLost %+v", e.Status.DeviceLost)
				}
			}
			if got != tc.lost {
				t.Fatalf("deviceLost.device = %q, want %q", got, tc.lost)
			}
		})
	}
}

// TestEngineDeviceLost: an engine with the fuse frontend and no device
// keeper serves a loop device; its process is SIGKILLed. The Engine
// reconciler starts another, which serves a fresh device, and records
// status.deviceLost naming the old one (the signal the workload
// controller restarts pods on).
func TestEngineDeviceLost(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the fuse frontend needs root (FUSE mount and loop device)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse")
	}
	g := NewWithT(t)
	ctx := context.Background()
	dir := t.TempDir()
	t.Cleanup(func() { releaseMounts(dir) }) // after the instance manager is killed
	im := imtest.Start(t, "node-dl", "", dir)
	e := createEngine(g, im, "node-dl", "vol-dl", v1.FrontendFUSE)
	t.Cleanup(func() {
		if err := client.IgnoreNotFound(k8sClient.Delete(ctx, e)); err != nil {
			t.Errorf("deleting the engine: %v", err)
		}
	})
	get := func() *v1.Engine {
		out := &v1.Engine{}
		g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(e), out)).To(Succeed())
		return out
	}
	g.Eventually(func() *v1.ServedDevice { return get().Status.ServedDevice }, timeout, 50*time.Millisecond).ShouldNot(BeNil())
	first := get().Status.ServedDevice.Path
	g.Expect(get().Status.DeviceLost).To(BeNil(), "a first start loses nothing")

	c, err := pool.Get(im.Addr)
	g.Expect(err).NotTo(HaveOccurred())
	p, ok, _ := c.Process(process.Name(e))
	g.Expect(ok).To(BeTrue())
	g.Expect(syscall.Kill(int(p.GetPid()), syscall.SIGKILL)).To(Succeed())

	g.Eventually(func() *v1.DeviceLoss { return get().Status.DeviceLost }, timeout, 50*time.Millisecond).ShouldNot(BeNil())
	lost := get().Status.DeviceLost
	g.Expect(lost.Device).To(Equal(first))
	g.Expect(lost.NodeName).To(Equal("node-dl"))
	g.Eventually(func() v1.InstanceState { return get().Status.InstanceState }, timeout, 50*time.Millisecond).Should(Equal(v1.InstanceStateRunning))
	g.Expect(get().Status.ServedDevice).NotTo(BeNil())
	g.Expect(get().Status.ServedDevice.Interrupted).To(BeFalse())
}

// releaseMounts lazily unmounts the FUSE mounts below dir that killed
// engines left, and detaches the loop devices backed by files below it.
// Best effort: what it cannot release fails the temporary directory's
// removal, which names it.
func releaseMounts(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			_ = exec.Command("umount", "-l", f[4]).Run()
		}
	}
	out, _ := exec.Command("losetup", "-n", "-O", "NAME,BACK-FILE").Output()
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) == 2 && strings.HasPrefix(f[1], dir+"/") {
			_ = exec.Command("losetup", "-d", f[0]).Run()
		}
	}
}
