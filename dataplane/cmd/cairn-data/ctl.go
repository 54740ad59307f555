package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
	"github.com/cairn-io/cairn/dataplane/internal/tlsfiles"
)

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

const ctlUsage = `usage: cairn-data ctl --engine HOST:PORT [--tls-cert F --tls-key F --tls-client-ca F] <command> [args]

An engine started by an instance manager with mutual TLS serves its control
API only to holders of a certificate of Cairn's CA: inside the instance
manager's pod, give its files (/etc/cairn/tls/tls.crt, tls.key, ca.crt).

commands:
  info                       size, frontend, endpoint and its kind, robustness, epoch
  replicas                   replicas and their modes (RW, WO, ERR)
  add ADDRESS [--wait]       add a replica and rebuild it (--wait: show progress until done)
  remove ADDRESS             drop a replica
  rebuilds                   rebuild progress
  cancel ADDRESS             cancel a rebuild
  snapshot create|delete|revert NAME
  snapshot list
  clone SOURCE SNAPSHOT [--wait]
                             fill the volume with SNAPSHOT of another volume, read from its
                             replica's control address SOURCE (a volume nobody uses)
  expand SIZE                grow the volume
  metrics                    operation counts and latency
  watch                      the status now and each time it changes, one line each (until interrupted)
`

func runCtl(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cairn-data ctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("engine", "", "the engine's control address (its --listen)")
	var files tlsfiles.Files
	fs.StringVar(&files.Cert, "tls-cert", "", "client certificate (PEM) of Cairn's CA, for an engine serving mutual TLS")
	fs.StringVar(&files.Key, "tls-key", "", "its private key (PEM)")
	fs.StringVar(&files.CA, "tls-client-ca", "", "CA bundle (PEM) the engine's certificate must chain to")
	fs.Usage = func() { fmt.Fprint(stderr, ctlUsage) }
	if err := fs.Parse(args); err != nil {
		return 2
	}
	rest := fs.Args()
	if *addr == "" || len(rest) == 0 {
		fs.Usage()
		return 2
	}
	creds := insecure.NewCredentials()
	if err := files.Check(); err != nil {
		fmt.Fprintln(stderr, "cairn-data ctl:", err)
		return 2
	}
	if files.Set() {
		src, err := tlsfiles.New(files, logr.Discard())
		if err != nil {
			fmt.Fprintln(stderr, "cairn-data ctl:", err)
			return 1
		}
		creds = credentials.NewTLS(src.Client())
	}
	cc, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		fmt.Fprintln(stderr, "cairn-data ctl:", err)
		return 1
	}
	defer cc.Close()
	c := enginev1.NewEngineServiceClient(cc)
	if err := ctlDo(ctx, c, rest, stdout); err != nil {
		fmt.Fprintln(stderr, "cairn-data ctl:", err)
		return 1
	}
	return 0
}

func arg(rest []string, i int, what string) (string, error) {
	if len(rest) <= i {
		return "", fmt.Errorf("%s: missing %s", rest[0], what)
	}
	return rest[i], nil
}

// ctlCommand runs one ctl command: rest is the command line from its
// name on.
type ctlCommand func(ctx context.Context, c enginev1.EngineServiceClient, rest []string, out io.Writer) error

// ctlCommands are the ctl commands by name (ctlUsage lists them).
var ctlCommands = map[string]ctlCommand{
	"info":     ctlInfo,
	"replicas": ctlReplicas,
	"add":      ctlAdd,
	"remove":   ctlRemove,
	"rebuilds": ctlRebuilds,
	"cancel":   ctlCancel,
	"snapshot": ctlSnapshot,
	"clone":    ctlClone,
	"expand":   ctlExpand,
	"metrics":  ctlMetrics,
	"watch":    ctlWatch,
}

func ctlDo(ctx context.Context, c enginev1.EngineServiceClient, rest []string, out io.Writer) error {
	cmd, ok := ctlCommands[rest[0]]
	if !ok {
		return fmt.Errorf("unknown command %q\n\n%s", rest[0], ctlUsage)
	}
	return cmd(ctx, c, rest, out)
}

func ctlInfo(ctx context.Context, c enginev1.EngineServiceClient, _ []string, out io.Writer) error {
	in, err := c.VolumeInfo(ctx, &enginev1.VolumeInfoRequest{})
	if err != nil {
		return err
	}
	endpoint := in.Endpoint
	if in.EndpointKind != "" {
		endpoint += " (" + in.EndpointKind + ")"
	}
	fmt.Fprintf(out, "volume %s: %s, %s frontend at %s, %s, epoch %d\n", in.Name, human(in.Size), in.Frontend, endpoint, in.Robustness, in.Epoch)
	if in.Fallback != "" {
		fmt.Fprintf(out, "no kernel block device: %s\n", in.Fallback)
	}
	return nil
}

func ctlReplicas(ctx context.Context, c enginev1.EngineServiceClient, _ []string, out io.Writer) error {
	rs, err := c.ReplicaList(ctx, &enginev1.ReplicaListRequest{})
	if err != nil {
		return err
	}
	for _, r := range rs.Replicas {
		line := fmt.Sprintf("%-4s %s", r.Mode, r.Address)
		if r.Error != "" {
			line += "  (" + r.Error + ")"
		}
		fmt.Fprintln(out, line)
	}
	return nil
}

func ctlAdd(ctx context.Context, c enginev1.EngineServiceClient, rest []string, out io.Writer) error {
	a, err := arg(rest, 1, "ADDRESS")
	if err != nil {
		return err
	}
	if _, err := c.ReplicaAdd(ctx, &enginev1.ReplicaAddRequest{Address: a}); err != nil {
		return err
	}
	fmt.Fprintf(out, "added %s (write-only); rebuilding\n", a)
	if len(rest) > 2 && rest[2] == "--wait" {
		return waitRebuild(ctx, c, a, out)
	}
	return nil
}

func ctlRemove(ctx context.Context, c enginev1.EngineServiceClient, rest []string, _ io.Writer) error {
	a, err := arg(rest, 1, "ADDRESS")
	if err != nil {
		return err
	}
	_, err = c.ReplicaRemove(ctx, &enginev1.ReplicaRemoveRequest{Address: a})
	return err
}

func ctlRebuilds(ctx context.Context, c enginev1.EngineServiceClient, _ []string, out io.Writer) error {
	rs, err := c.RebuildStatus(ctx, &enginev1.RebuildStatusRequest{})
	if err != nil {
		return err
	}
	for _, r := range rs.Rebuilds {
		fmt.Fprintln(out, rebuildLine(r))
	}
	return nil
}

func ctlCancel(ctx context.Context, c enginev1.EngineServiceClient, rest []string, _ io.Writer) error {
	a, err := arg(rest, 1, "ADDRESS")
	if err != nil {
		return err
	}
	_, err = c.RebuildCancel(ctx, &enginev1.RebuildCancelRequest{Replica: a})
	return err
}

func ctlSnapshot(ctx context.Context, c enginev1.EngineServiceClient, rest []string, out io.Writer) error {
	sub, err := arg(rest, 1, "create, list, delete or revert")
	if err != nil {
		return err
	}
	if sub == "list" {
		ss, err := c.SnapshotList(ctx, &enginev1.SnapshotListRequest{})
		if err != nil {
			return err
		}
		for _, s := range ss.Snapshots {
			fmt.Fprintf(out, "%s\t%s\t%s\tuser=%v\n", s.Name, time.Unix(0, s.CreatedUnixNano).UTC().Format(time.RFC3339), human(s.DataBytes), s.UserCreated)
		}
		return nil
	}
	name, err := arg(rest, 2, "NAME")
	if err != nil {
		return err
	}
	switch sub {
	case "create":
		_, err = c.SnapshotCreate(ctx, &enginev1.SnapshotCreateRequest{Name: name})
	case "delete":
		_, err = c.SnapshotDelete(ctx, &enginev1.SnapshotDeleteRequest{Name: name})
	case "revert":
		_, err = c.SnapshotRevert(ctx, &enginev1.SnapshotRevertRequest{Name: name})
	default:
		return fmt.Errorf("snapshot %s: use create, list, delete or revert", sub)
	}
	return err
}

func ctlClone(ctx context.Context, c enginev1.EngineServiceClient, rest []string, out io.Writer) error {
	src, err := arg(rest, 1, "SOURCE")
	if err != nil {
		return err
	}
	snap, err := arg(rest, 2, "SNAPSHOT")
	if err != nil {
		return err
	}
	if _, err := c.CloneFrom(ctx, &enginev1.CloneFromRequest{Source: src, Snapshot: snap}); err != nil {
		return err
	}
	fmt.Fprintf(out, "copying snapshot %s from %s\n", snap, src)
	if len(rest) > 3 && rest[3] == "--wait" {
		return waitClone(ctx, c, out)
	}
	return nil
}

func ctlExpand(ctx context.Context, c enginev1.EngineServiceClient, rest []string, _ io.Writer) error {
	s, err := arg(rest, 1, "SIZE")
	if err != nil {
		return err
	}
	size, err := parseSize(s)
	if err != nil {
		return err
	}
	_, err = c.Expand(ctx, &enginev1.ExpandRequest{Size: size})
	return err
}

func ctlMetrics(ctx context.Context, c enginev1.EngineServiceClient, _ []string, out io.Writer) error {
	m, err := c.Metrics(ctx, &enginev1.MetricsRequest{})
	if err != nil {
		return err
	}
	for _, x := range []struct {
		n string
		m *enginev1.OpMetrics
	}{{"read", m.Read}, {"write", m.Write}, {"flush", m.Flush}, {"unmap", m.Unmap}} {
		fmt.Fprintf(out, "%-6s ops=%d bytes=%d errors=%d\n", x.n, x.m.GetOps(), x.m.GetBytes(), x.m.GetErrors())
	}
	for _, r := range m.Replicas {
		fmt.Fprintf(out, "replica %s: read ops=%d write ops=%d (shared memory %d) errors=%d\n", r.Address, r.Read.GetOps(), r.Write.GetOps(),
			r.SharedWrites, r.Read.GetErrors()+r.Write.GetErrors()+r.Flush.GetErrors()+r.Unmap.GetErrors())
	}
	return nil
}

// ctlWatch prints the volume's status at every change until interrupted.
func ctlWatch(ctx context.Context, c enginev1.EngineServiceClient, _ []string, out io.Writer) error {
	w, err := c.Watch(ctx, &enginev1.WatchRequest{})
	if err != nil {
		return err
	}
	for {
		st, err := w.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil // interrupted
			}
			return err
		}
		fmt.Fprintln(out, statusLine(st))
	}
}

func rebuildLine(r *enginev1.Rebuild) string {
	pct := 100
	if r.BytesTotal > 0 {
		pct = int(r.BytesDone * 100 / r.BytesTotal)
	}
	kind := fmt.Sprintf("full, %d layers", len(r.Layers))
	if len(r.Layers) == 1 {
		kind = "full, 1 layer"
	}
	if r.DirtyOnly {
		kind = "dirty regions only"
	}
	state := r.State
	if state == "in-progress" && r.BytesDone >= r.BytesTotal {
		state = "verifying" // copied; checksums being compared
	}
	s := fmt.Sprintf("%s: %s %3d%% (%s of %s, %s copied, %s) from %s", r.Replica, state, pct,
		human(r.BytesDone), human(r.BytesTotal), human(r.BytesCopied), kind, r.Source)
	if r.FullReason != "" {
		s += "; full because " + r.FullReason
	}
	if r.RelayReason != "" {
		s += "; through the engine because " + r.RelayReason
	}
	if r.Error != "" {
		s += ": " + r.Error
	}
	return s
}

// cloneLine is a clone copy's progress on one line.
func cloneLine(cl *enginev1.Clone) string {
	pct := int64(0)
	if cl.BytesTotal > 0 {
		pct = cl.BytesDone * 100 / cl.BytesTotal
	}
	s := fmt.Sprintf("clone of %s from %s: %s %3d%% (%s copied)", cl.Snapshot, cl.Source, cl.State, pct, human(cl.BytesCopied))
	if cl.Error != "" {
		s += ": " + cl.Error
	}
	return s
}

// waitClone prints the clone's progress until it ends, from the engine's
// status stream.
func waitClone(ctx context.Context, c enginev1.EngineServiceClient, out io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := c.Watch(ctx, &enginev1.WatchRequest{})
	if err != nil {
		return err
	}
	last := ""
	for {
		st, err := w.Recv()
		if err != nil {
			return err
		}
		cl := st.GetClone()
		if cl == nil {
			continue
		}
		if line := cloneLine(cl); line != last {
			fmt.Fprintln(out, "  "+line)
			last = line
		}
		switch cl.State {
		case "complete":
			return nil
		case "failed":
			return fmt.Errorf("clone failed: %s", cl.Error)
		}
	}
}

// statusLine is one Watch message on one line.
func statusLine(st *enginev1.VolumeStatus) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d: %s (%s of data), %s, epoch %d; replicas", st.Seq, human(st.Size), human(st.GetActualSize()), st.Robustness, st.Epoch)
	for _, r := range st.Replicas {
		fmt.Fprintf(&b, " %s %s", r.Mode, r.Address)
	}
	for _, r := range st.Rebuilds {
		if r.State == "in-progress" {
			fmt.Fprintf(&b, "; rebuild %s", rebuildLine(r))
		}
	}
	if cl := st.GetClone(); cl != nil && cl.State == "in-progress" {
		b.WriteString("; " + cloneLine(cl))
	}
	b.WriteString("; snapshots")
	if len(st.Snapshots) == 0 {
		b.WriteString(" none")
	}
	for _, x := range st.Snapshots {
		b.WriteString(" " + x.Name)
	}
	return b.String()
}

// waitRebuild prints progress until the rebuild of addr ends, from the
// engine's status stream.
func waitRebuild(ctx context.Context, c enginev1.EngineServiceClient, addr string, out io.Writer) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := c.Watch(ctx, &enginev1.WatchRequest{})
	if err != nil {
		return err
	}
	last := ""
	for {
		st, err := w.Recv()
		if err != nil {
			return err
		}
		for _, r := range st.Rebuilds {
			if r.Replica != addr {
				continue
			}
			if line := rebuildLine(r); line != last {
				fmt.Fprintln(out, "  "+line)
				last = line
			}
			switch r.State {
			case "complete":
				return nil
			case "failed", "cancelled":
				return fmt.Errorf("rebuild of %s %s: %s", addr, r.State, r.Error)
			}
		}
	}
}
