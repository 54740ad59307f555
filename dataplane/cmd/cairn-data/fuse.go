package main

import (
	"errors"

	"github.com/go-logr/logr"

	"github.com/cairn-io/cairn/dataplane/engine"
)

func startFUSE(e *engine.Engine, name, dir string, log logr.Logger) (*frontend, error) {
	return nil, errors.New("--frontend fuse is not available yet")
}
