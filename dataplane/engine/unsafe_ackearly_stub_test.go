//go:build !cairn_unsafe

package engine_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cairn-io/cairn/dataplane/engine"
)

// TestUnsafeAckEarlyRefusedInANormalBuild: without -tags cairn_unsafe the
// deliberately broken write path is not built in, and Open refuses
// UnsafeAckEarly (what cairn-data passes for CAIRN_UNSAFE_ACK_EARLY=1)
// with an error naming the tag, before it touches a replica: a production
// binary started with the variable refuses to start, and does not fence
// out the engine serving the volume. (It used to open and run unsafely.)
func TestUnsafeAckEarlyRefusedInANormalBuild(t *testing.T) {
	tr := startReplica(t, filepath.Join(t.TempDir(), "r"), 1<<20, "")
	before := tr.run.Replica.Epoch()
	e, err := engine.Open(context.Background(), engine.Options{Replicas: []string{tr.addr}, Dial: dialer(), UnsafeAckEarly: true})
	if err == nil {
		e.Close()
	}
	if !errors.Is(err, engine.ErrUnsafeNotBuilt) || !strings.Contains(err.Error(), "-tags cairn_unsafe") {
		t.Fatalf("Open with UnsafeAckEarly in a normal build: %v; want ErrUnsafeNotBuilt, naming the build tag", err)
	}
	if after := tr.run.Replica.Epoch(); after != before {
		t.Fatalf("the refused Open fenced the replica: epoch %d -> %d", before, after)
	}
}
