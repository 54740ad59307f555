//go:build linux

package nbd

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// KernelMode says whether a Frontend attaches its volume to a /dev/nbdN.
type KernelMode string

// Kernel modes.
const (
	// KernelAuto attaches /dev/nbdN where the host has the nbd driver and
	// allows it; otherwise the socket serves alone and Fallback says why.
	KernelAuto KernelMode = "auto"
	// KernelOn requires /dev/nbdN: without it Claim or Start fails.
	KernelOn KernelMode = "on"
	// KernelOff serves the socket only and never touches the driver.
	KernelOff KernelMode = "off"
)

// FrontendOptions configure Claim.
type FrontendOptions struct {
	// Name is the volume's name: the export name, the kernel device's
	// backend (how a restarted engine finds the device) and the name of
	// the device lock.
	Name string
	// Listener listens on the NBD socket, whose path is Socket. The caller
	// opens it; Claim takes it over (it is closed and the path removed on
	// a failure and by Stop).
	Listener net.Listener
	Socket   string
	Kernel   KernelMode
	// ReattachWait is how long the kernel holds /dev/nbdN's I/O when the
	// engine dies, for an engine started again to reattach the device (see
	// KernelOptions.DeadConnTimeoutSeconds).
	ReattachWait time.Duration
	// Buffers and Logger are the server's (see Options).
	Buffers *shm.Arena
	Logger  logr.Logger
}

// Frontend is a volume's nbd frontend: its NBD socket and, where the
// kernel allows it, the /dev/nbdN attached to it.
//
// It starts in two steps because opening the replicas fences out any
// engine that has them: Claim takes what must be this engine's alone (the
// socket and, for a kernel device, the volume's device lock) before the
// engine opens the replicas, so that a second engine started by mistake
// for a running volume fails there and leaves the running one alone;
// Start then serves the opened volume.
type Frontend struct {
	opts FrontendOptions
	log  logr.Logger
	// lock is the abstract unix socket "@cairn-nbd/NAME", held while this
	// engine may own the volume's /dev/nbdN (the kernel frees it when the
	// process dies, however it dies); nil without a kernel device.
	lock net.Listener
	// noDevice says why there is no kernel device (KernelAuto on a host
	// without the driver); nil otherwise.
	noDevice error
	server   *Server
	device   *KernelDevice // nil without one
	fallback string
	// resumed: device is a /dev/nbdN a dead engine of the volume left,
	// reattached with the I/O it held.
	resumed  bool
	stopOnce sync.Once
	stopErr  error
}

// Claim takes the socket and, unless the mode is KernelOff or the kernel
// has no nbd driver, the volume's device lock. It fails with KernelOn on
// a host without the driver, and when another engine on the node holds
// the volume's device lock.
func Claim(opts FrontendOptions) (*Frontend, error) {
	f := &Frontend{opts: opts, log: opts.Logger}
	switch opts.Kernel {
	case KernelAuto, KernelOn:
		f.noDevice = KernelDriver()
	case KernelOff:
	default:
		f.release()
		return nil, fmt.Errorf("kernel mode %q: use auto, on or off", opts.Kernel)
	}
	if f.noDevice != nil && opts.Kernel == KernelOn {
		f.release()
		return nil, f.noDevice
	}
	if opts.Kernel != KernelOff && f.noDevice == nil {
		lock, err := net.Listen("unix", "@cairn-nbd/"+opts.Name)
		if err != nil {
			f.release()
			return nil, fmt.Errorf("volume %s: another engine on this node owns its /dev/nbdN (it holds the abstract socket @cairn-nbd/%s: %w); stop that engine first", opts.Name, opts.Name, err)
		}
		f.lock = lock
	}
	return f, nil
}

// release gives the claim up.
func (f *Frontend) release() {
	f.opts.Listener.Close()
	os.Remove(f.opts.Socket)
	if f.lock != nil {
		f.lock.Close()
	}
}

// Start serves dev on the claimed socket and, where the claim holds the
// device lock, attaches it to a /dev/nbdN through the kernel's nbd driver
// (or reattaches the one a dead engine of the volume left); the device is
// then the endpoint. With KernelAuto, a host without the driver or
// without the privilege gets the socket alone, and Fallback says why;
// with KernelOn that is an error. A device of the volume that exists but
// cannot be reattached is an error in both modes: serving the socket
// alone would leave whatever uses the device without a server. On an
// error the claim is released.
func (f *Frontend) Start(dev Device) error {
	f.server = NewServer(dev, Options{ExportName: f.opts.Name, Buffers: f.opts.Buffers, Logger: f.log})
	go func() {
		if err := f.server.Serve(f.opts.Listener); err != nil {
			f.log.Info("nbd listener failed: " + err.Error())
		}
	}()
	if f.opts.Kernel == KernelOff {
		return nil
	}
	err := f.noDevice // never set with KernelOn: Claim refused that
	if err == nil {
		f.device, err = f.attach()
	}
	if err != nil {
		var owned *deviceOwnedError
		if f.opts.Kernel == KernelOn || errors.As(err, &owned) {
			return errors.Join(err, f.Stop())
		}
		f.fallback = err.Error()
		f.log.Info("no /dev/nbdN, serving the NBD socket " + f.opts.Socket + " only: " + f.fallback)
	}
	return nil
}

// deviceOwnedError: the volume's /dev/nbdN exists and this engine cannot
// take it.
type deviceOwnedError struct{ error }

func (e *deviceOwnedError) Unwrap() error { return e.error }

// attach attaches the volume to a /dev/nbdN, or reattaches the one an
// engine of the same volume left behind when it died: a device whose
// backend is the volume's name and which is still configured (this engine
// holds the volume's device lock, so that engine is gone). The kernel
// holds that device's I/O for up to ReattachWait after its engine died,
// so a filesystem mounted on it carries on once the new engine is up.
func (f *Frontend) attach() (*KernelDevice, error) {
	name := f.opts.Name
	opts := KernelOptions{Backend: name, DeadConnTimeoutSeconds: uint64((f.opts.ReattachWait + time.Second - 1) / time.Second)}
	if index, found := FindKernelDevice(name); found {
		kd, err := ReattachKernel(f.server, index, opts)
		if err != nil {
			return nil, &deviceOwnedError{fmt.Errorf("/dev/nbd%d belongs to volume %s, left by an engine that stopped without detaching it, and reattaching it failed: %w; "+
				"release it with `nbd-client -d /dev/nbd%d` (writes it holds are lost) and start the engine again", index, name, err, index)}
		}
		f.log.Info(fmt.Sprintf("reattached %s, left attached by an engine of volume %s that stopped without detaching it; the I/O it held goes on", kd.Path(), name))
		f.resumed = true
		return kd, nil
	}
	kd, err := ConnectKernel(f.server, opts)
	if err != nil {
		return nil, err
	}
	f.log.Info("attached " + kd.Path() + " through the kernel's nbd driver")
	return kd, nil
}

// Endpoint is where the volume is served: the kernel device, or the
// socket without one.
func (f *Frontend) Endpoint() string {
	if f.device != nil {
		return f.device.Path()
	}
	return f.opts.Socket
}

// Socket is the NBD socket's path.
func (f *Frontend) Socket() string { return f.opts.Socket }

// Device is the attached /dev/nbdN, or nil.
func (f *Frontend) Device() *KernelDevice { return f.device }

// Fallback says why a frontend in KernelAuto mode has no kernel device
// ("" when it has one, or was not to have one).
func (f *Frontend) Fallback() string { return f.fallback }

// Resumed reports whether the kernel device is the one a dead engine of
// the volume left, reattached: its users kept their I/O and mounts.
func (f *Frontend) Resumed() bool { return f.resumed }

// InUse says what uses the volume ("" when nothing does): the kernel
// device, or the socket's clients.
func (f *Frontend) InUse() string {
	if f.device != nil {
		return "attached as " + f.device.Path()
	}
	if n := f.server.Clients(); n > 0 {
		return fmt.Sprintf("%d NBD client connection(s)", n)
	}
	return ""
}

// Resize has the kernel device show the volume's new size (see
// KernelDevice.Resize); without a device there is nothing to resize
// (socket clients learn the size when they connect).
func (f *Frontend) Resize(size int64) error {
	if f.device == nil {
		return nil
	}
	return f.device.Resize(size)
}

// Leave stops the frontend as Stop does, except that the kernel device
// stays attached for the next engine of the volume, as if this engine had
// died: the requests read from the device are answered first (a write
// acknowledged is on the replicas, a flush acknowledged flushed them),
// then the kernel finds the connections dead and holds the device's I/O
// for ReattachWait, until the next engine reattaches it (attach). Where
// the device is in use, its users see a pause rather than an error. If no
// engine comes within ReattachWait, the kernel fails the held I/O, as
// after a crash. Without a device, or with a ReattachWait of 0 (the
// kernel would fail the I/O at once), Leave is Stop.
func (f *Frontend) Leave() error {
	if f.device == nil || f.opts.ReattachWait <= 0 {
		return f.Stop()
	}
	f.stopOnce.Do(func() {
		f.device.Leave()
		f.server.Close()
		f.release()
		f.log.Info(fmt.Sprintf("left %s attached for the next engine of volume %s: the kernel holds its I/O for up to %s", f.device.Path(), f.opts.Name, f.opts.ReattachWait))
	})
	return f.stopErr
}

// Stop detaches the kernel device, stops serving and releases the claim;
// it may be called on a frontend claimed but never started.
func (f *Frontend) Stop() error {
	f.stopOnce.Do(func() {
		if f.device != nil {
			f.stopErr = f.device.Disconnect()
		}
		if f.server != nil {
			f.server.Close()
		}
		f.release()
	})
	return f.stopErr
}
