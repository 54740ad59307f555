package main

import (
	"context"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/devicekeeper"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/frontend/fuse"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
	"github.com/cairn-io/cairn/dataplane/internal/shm"
)

// fuseClaim is the fuse frontend before it serves (with the session it
// took over from the device keeper, if any) and the engine's link to the
// keeper, which lives as long as the engine.
type fuseClaim struct {
	f      *fuse.Frontend
	keeper *devicekeeper.Client
}

// claimFUSE prepares the fuse frontend: with --device-keeper, it takes
// over the device the keeper holds for the volume. It fails if another
// engine of the volume serves that device, before the replicas are opened
// (which would fence that engine out).
func claimFUSE(c *engineFlags, buffers *shm.Arena, log logr.Logger) (*fuseClaim, error) {
	fc := &fuseClaim{}
	opts := fuse.Options{Name: c.name, Dir: c.fuseDir, Buffers: buffers, Logger: log.WithName("fuse")}
	if c.deviceKeeper != "" {
		fc.keeper = devicekeeper.NewClient(c.deviceKeeper, log.WithName("device-keeper"))
		opts.Keeper = fc.keeper
	}
	f, err := fuse.Claim(opts)
	if err != nil {
		fc.close()
		return nil, err
	}
	fc.f = f
	return fc, nil
}

// close gives back a session claimed and never served (the keeper goes on
// holding it) and ends the link to the keeper. After the frontend stopped.
func (fc *fuseClaim) close() {
	if fc.f != nil {
		fc.f.Release()
	}
	if fc.keeper != nil {
		fc.keeper.Close()
	}
}

func startFUSE(e *engine.Engine, fc *fuseClaim, log logr.Logger) (*frontend, error) {
	f := fc.f
	if err := f.Start(e); err != nil {
		return nil, err
	}
	return &frontend{endpoint: f.Endpoint(), kind: ready.EndpointLoopDevice, resumed: f.Resumed(),
		inUse:  func() string { return "attached as " + f.Endpoint() },
		resize: func(_ context.Context, size int64) error { return f.Resize(size) },
		stop: func() {
			if err := f.Stop(); err != nil {
				log.Error(err, "detaching the fuse frontend")
			}
		}}, nil
}
