package chaos

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/dataconn"
	"github.com/cairn-io/cairn/dataplane/engine"
	"github.com/cairn-io/cairn/dataplane/engine/replicaclient"
)

// staleEngine is an engine that a newer one has fenced out, as an engine
// reaches its replicas: a replica client each (the engine's own client
// package), all of one owner, which set epoch 1 on every replica before
// the schedule's first engine opened them at a newer epoch. Once the
// schedule has healed it tries to change every replica's chain and size,
// and to take the replicas back at the running engine's epoch: the
// replicas must refuse every attempt for its epoch, and their chains must
// stay as they were.
type staleEngine struct {
	clients []*replicaclient.Client // one per node, in c.nodes' order
}

// staleName is the snapshot the stale engine tries to take.
const staleName = "stale-engine"

// newStaleEngine sets epoch 1 on every replica, before any engine runs.
func (c *cluster) newStaleEngine(ctx context.Context) (*staleEngine, error) {
	dial := replicaclient.Dialer(replicaclient.Options{Data: dataconn.ClientOptions{Conns: 1}, QuickTimeout: 5 * time.Second, ControlTimeout: 10 * time.Second})
	s := &staleEngine{}
	for _, n := range c.nodes {
		r, err := dial(ctx, n.addr())
		if err != nil {
			s.close()
			return nil, fmt.Errorf("stale engine: %w", err)
		}
		cl := r.(*replicaclient.Client)
		s.clients = append(s.clients, cl)
		if err := cl.SetEpoch(ctx, engine.EpochState{Epoch: 1}); err != nil {
			s.close()
			return nil, fmt.Errorf("stale engine: set epoch 1 on replica %d: %w", n.idx, err)
		}
	}
	return s, nil
}

func (s *staleEngine) close() {
	for _, cl := range s.clients {
		cl.Close()
	}
}

// userChain is a chain without the rebuild snapshots, which the running
// engine deletes on its own after a rebuild, possibly while the stale
// engine tries.
func userChain(snaps []engine.SnapshotInfo) []string {
	var out []string
	for _, sn := range snaps {
		if !strings.HasPrefix(sn.Name, "rebuild-") {
			out = append(out, sn.Name+"@"+sn.Created.UTC().Format(time.RFC3339Nano))
		}
	}
	return out
}

// try makes the stale engine's attempts on every replica and returns what
// went wrong: an attempt that was not refused for its epoch, or a chain or
// size that changed.
func (s *staleEngine) try(ctx context.Context, c *cluster) []string {
	var problems []string
	// A snapshot to try to delete and revert to, if the schedule took none:
	// a revert that got through would lose writes.
	list, err := c.ctl.SnapshotList(ctx, &enginev1.SnapshotListRequest{})
	if err == nil && len(list.Snapshots) == 0 {
		_, err = c.ctl.SnapshotCreate(ctx, &enginev1.SnapshotCreateRequest{Name: "stale-target"})
	}
	if err != nil {
		return []string{"stale engine: a snapshot to try on: " + err.Error()}
	}
	for i, n := range c.nodes {
		cl := s.clients[i]
		before, err := cl.Info(ctx)
		if err != nil {
			problems = append(problems, fmt.Sprintf("stale engine: info of replica %d: %v", n.idx, err))
			continue
		}
		target := "stale-target"
		if len(before.Snapshots) > 0 {
			target = before.Snapshots[0].Name
		}
		attempts := []struct {
			what string
			call func() error
		}{
			{"snapshot " + staleName, func() error {
				return cl.Snapshot(ctx, engine.SnapshotInfo{Name: staleName, UserCreated: true})
			}},
			{"revert to " + target, func() error { return cl.Revert(ctx, target) }},
			{"delete snapshot " + target, func() error { return cl.DeleteSnapshot(ctx, target) }},
			{"expand", func() error { return cl.Expand(ctx, before.Size+1<<20) }},
			{fmt.Sprintf("set epoch %d (the running engine's)", before.Epoch), func() error {
				return cl.SetEpoch(ctx, engine.EpochState{Epoch: before.Epoch})
			}},
		}
		for _, a := range attempts {
			if err := a.call(); !errors.Is(err, replicaclient.ErrStaleEpoch) {
				problems = append(problems, fmt.Sprintf("stale engine: %s on replica %d was not refused for its epoch: %v", a.what, n.idx, err))
			}
		}
		after, err := cl.Info(ctx)
		if err != nil {
			problems = append(problems, fmt.Sprintf("stale engine: info of replica %d: %v", n.idx, err))
			continue
		}
		if b, a := userChain(before.Snapshots), userChain(after.Snapshots); !slices.Equal(b, a) || after.Size != before.Size {
			problems = append(problems, fmt.Sprintf("stale engine: replica %d changed under its attempts: snapshots %v, size %d; before %v, size %d",
				n.idx, a, after.Size, b, before.Size))
		}
	}
	return problems
}
