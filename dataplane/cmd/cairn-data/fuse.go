package main

import (
	"context"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/frontend/fuse"
	"github.com/cairn-io/cairn/dataplane/internal/ready"
)

func startFUSE(e *engine.Engine, name, dir string, log logr.Logger) (*frontend, error) {
	f, err := fuse.Start(e, fuse.Options{Name: name, Dir: dir, Logger: log.WithName("fuse")})
	if err != nil {
		return nil, err
	}
	return &frontend{endpoint: f.Endpoint(), kind: ready.EndpointLoopDevice,
		inUse:  func() string { return "attached as " + f.Endpoint() },
		resize: func(_ context.Context, size int64) error { return f.Resize(size) },
		stop: func() {
			if err := f.Stop(); err != nil {
				log.Error(err, "detaching the fuse frontend")
			}
		}}, nil
}
