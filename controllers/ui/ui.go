// Package ui is Cairn's read-only web page, served by the manager
// (--ui-bind-address) for `kubectl port-forward`: volumes with their
// health and I/O sparklines, replicas by node, rebuild progress, disks and
// recent events, each volume with the claim (PersistentVolumeClaim) of its
// PersistentVolume. ?volume=NAME or ?volume=NAMESPACE/CLAIM shows one
// volume. It is rendered on the server (no script), from the manager's
// cache, uncached reads of the events of its namespace and of the
// PersistentVolumes, and a short history of each running engine's I/O
// counters that it samples itself.
package ui

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/claims"
	"github.com/cairn-io/cairn/controllers/display"
	"github.com/cairn-io/cairn/controllers/metrics"
)

//go:embed page.html
var files embed.FS

var page = template.Must(template.New("page.html").Funcs(template.FuncMap{
	"pct": func(f float64) string { return fmt.Sprintf("%.0f%%", 100*f) },
}).ParseFS(files, "page.html"))

// historyLen is how many samples a sparkline shows.
const historyLen = 60

// Server serves the page.
type Server struct {
	// Client reads Cairn's objects (the manager's cache).
	Client client.Reader
	// Events reads the namespace's events without a cache (the
	// manager's APIReader); nil: no events shown.
	Events client.Reader
	// Claims reads PersistentVolumes and claims without a cache (the
	// manager's APIReader); nil: no claims shown, none accepted.
	Claims client.Reader
	// Namespace holds Cairn's objects and events.
	Namespace string
	// Engines gives the running engines to sample; nil: no I/O.
	Engines func() metrics.Engines
	// Interval between I/O samples (default 5 s).
	Interval time.Duration
	Logger   logr.Logger

	mu      sync.Mutex
	history map[types.NamespacedName]*series // by Engine
}

// series is an engine's recent I/O: counters at each sample, and the
// rates between them.
type series struct {
	last       time.Time
	reads      uint64
	writes     uint64
	readRates  []float64
	writeRates []float64
	seen       bool
}

// NeedLeaderElection: every manager replica serves its page.
func (s *Server) NeedLeaderElection() bool { return false }

// Start samples the engines every Interval until ctx ends.
func (s *Server) Start(ctx context.Context) error {
	iv := s.Interval
	if iv <= 0 {
		iv = 5 * time.Second
	}
	t := time.NewTicker(iv)
	defer t.Stop()
	for {
		s.Sample(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Sample reads every running engine's counters once and appends the
// rates since the previous sample to its history.
func (s *Server) Sample(ctx context.Context) {
	if s.Engines == nil {
		return
	}
	es := s.Engines()
	if es == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	got := metrics.Poll(ctx, es, s.Logger)
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.history == nil {
		s.history = map[types.NamespacedName]*series{}
	}
	for key, m := range got {
		reads, writes := m.GetRead().GetOps(), m.GetWrite().GetOps()
		h := s.history[key]
		if h == nil {
			h = &series{}
			s.history[key] = h
		}
		// A counter that went down is a restarted engine: start over.
		if h.seen && reads >= h.reads && writes >= h.writes {
			dt := now.Sub(h.last).Seconds()
			if dt > 0 {
				h.readRates = appendCapped(h.readRates, float64(reads-h.reads)/dt)
				h.writeRates = appendCapped(h.writeRates, float64(writes-h.writes)/dt)
			}
		}
		h.last, h.reads, h.writes, h.seen = now, reads, writes, true
	}
	for k := range s.history {
		if _, live := got[k]; !live {
			delete(s.history, k)
		}
	}
}

func appendCapped(xs []float64, x float64) []float64 {
	xs = append(xs, x)
	if len(xs) > historyLen {
		xs = xs[len(xs)-historyLen:]
	}
	return xs
}

// Spark is a sparkline: an SVG polyline's points and the last value.
type Spark struct {
	Points string
	Last   float64
	Max    float64
}

func spark(xs []float64) Spark {
	if len(xs) == 0 {
		return Spark{}
	}
	peak := 1.0
	for _, x := range xs {
		peak = max(peak, x)
	}
	var b strings.Builder
	const w, h = 120.0, 24.0
	step := w / float64(historyLen-1)
	off := float64(historyLen - len(xs))
	for i, x := range xs {
		fmt.Fprintf(&b, "%.1f,%.1f ", (off+float64(i))*step, h-1-(h-2)*x/peak)
	}
	return Spark{Points: strings.TrimSpace(b.String()), Last: xs[len(xs)-1], Max: peak}
}

// The page's data.
type (
	pageData struct {
		Namespace string
		// Filter is the ?volume= asked for; Notice says why it shows
		// nothing of it.
		Filter, Notice string
		Generated      string
		Volumes        []volumeRow
		Nodes          []nodeRow
		Rebuilds       []rebuildRow
		Backups        []backupRow
		Events         []eventRow
		Counts         map[string]int
	}
	volumeRow struct {
		Name, State, Robustness, Size, Node string
		Claim                               string // namespace/name; "" if none
		Used                                string // status.actualSize; "" until reported
		Replicas, RW                        int
		Reads, Writes                       Spark
		Message                             string
	}
	nodeRow struct {
		Name     string
		Disks    []diskRow
		Replicas []replicaRow
	}
	diskRow struct {
		Name                           string
		Capacity, Available, Scheduled string
		Used, ScheduledFrac            float64
	}
	replicaRow struct{ Name, Volume, Claim, Mode, State string }
	rebuildRow struct {
		Volume, Replica, Source, State, Kind, Done, Total string
		Progress                                          float64
	}
	eventRow  struct{ Time, Type, Object, Reason, Message string }
	backupRow struct {
		Volume, Name, Target, State, Done, Total, Uploaded, Detail string
		Progress                                                   float64
	}
)

// ServeHTTP renders the page.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	d, err := s.data(r.Context(), strings.TrimSpace(r.URL.Query().Get("volume")))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	// The filter is a GET form to this page, and nothing else is allowed.
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'")
	if d.Notice != "" {
		w.WriteHeader(http.StatusNotFound)
	}
	if err := page.Execute(w, d); err != nil {
		s.Logger.Error(err, "ui: render")
	}
}

// data gathers what the page shows: every volume (or only the one the
// filter names), the nodes with their disks and replicas, rebuilds in
// progress and the newest events.
func (s *Server) data(ctx context.Context, filter string) (*pageData, error) {
	in := client.InNamespace(s.Namespace)
	var vols v1.VolumeList
	var engs v1.EngineList
	var reps v1.ReplicaList
	var nodes v1.StorageNodeList
	for _, l := range []client.ObjectList{&vols, &engs, &reps, &nodes} {
		if err := s.Client.List(ctx, l, in); err != nil {
			return nil, fmt.Errorf("list %T: %w", l, err)
		}
	}
	d := &pageData{Namespace: s.Namespace, Generated: time.Now().UTC().Format(time.RFC3339), Counts: map[string]int{}, Filter: filter}
	claimOf := s.claims(ctx)
	only, notice, err := s.only(ctx, filter, vols.Items)
	if err != nil {
		return nil, err
	}
	d.Notice = notice
	shown := func(vol string) bool { return only == "" || vol == only }
	engineOf := map[string]*v1.Engine{} // by volume: a volume has one Engine
	for i := range engs.Items {
		engineOf[engs.Items[i].Spec.VolumeName] = &engs.Items[i]
	}
	d.Volumes = volumeRows(vols.Items, engineOf, s.historyCopy(), claimOf, shown, d.Counts)
	d.Nodes = nodeRows(nodes.Items, reps.Items, engineOf, claimOf, shown)
	d.Rebuilds = rebuildRows(engs.Items, shown)
	var backups v1.BackupList
	if err := s.Client.List(ctx, &backups, in); err != nil {
		return nil, fmt.Errorf("list backups: %w", err)
	}
	d.Backups = backupRows(backups.Items, shown)
	d.Events = s.eventRows(ctx, in)
	return d, nil
}

// historyCopy is a copy of every engine's I/O history, taken under the
// lock so that rendering does not hold it.
func (s *Server) historyCopy() map[types.NamespacedName]series {
	s.mu.Lock()
	defer s.mu.Unlock()
	hist := map[types.NamespacedName]series{}
	for k, v := range s.history {
		hist[k] = *v
	}
	return hist
}

// nodeRows are the nodes, sorted by name, each with its disks and the
// replicas of shown volumes on it (sorted by name); a node with replicas
// but no StorageNode is listed too.
func nodeRows(nodes []v1.StorageNode, reps []v1.Replica, engineOf map[string]*v1.Engine, claimOf map[string]string,
	shown func(string) bool) []nodeRow {
	byNode := map[string]*nodeRow{}
	nodeOf := func(n string) *nodeRow {
		if byNode[n] == nil {
			byNode[n] = &nodeRow{Name: n}
		}
		return byNode[n]
	}
	for _, n := range nodes {
		name := n.Spec.NodeName
		if name == "" {
			name = n.Name
		}
		nr := nodeOf(name)
		for _, disk := range n.Status.Disks {
			nr.Disks = append(nr.Disks, diskRowOf(disk))
		}
	}
	for _, r := range reps {
		if r.Spec.NodeName == "" || !shown(r.Spec.VolumeName) {
			continue
		}
		mode := ""
		if e := engineOf[r.Spec.VolumeName]; e != nil {
			mode = string(e.Status.ReplicaModeMap[r.Name])
		}
		nr := nodeOf(r.Spec.NodeName)
		nr.Replicas = append(nr.Replicas, replicaRow{Name: r.Name, Volume: r.Spec.VolumeName, Claim: claimOf[r.Spec.VolumeName],
			Mode: mode, State: string(r.Status.InstanceState)})
	}
	var out []nodeRow
	for _, nr := range byNode {
		sort.Slice(nr.Replicas, func(i, j int) bool { return nr.Replicas[i].Name < nr.Replicas[j].Name })
		out = append(out, *nr)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// diskRowOf is one disk's sizes, and how full and how promised it is as
// fractions of its capacity (0 when the capacity is not known).
func diskRowOf(disk v1.DiskStatus) diskRow {
	dr := diskRow{Name: disk.Name}
	var capacity, avail, sched int64
	if disk.Capacity != nil {
		capacity = disk.Capacity.Value()
	}
	if disk.Available != nil {
		avail = disk.Available.Value()
	}
	if disk.Scheduled != nil {
		sched = disk.Scheduled.Value()
	}
	dr.Capacity, dr.Available, dr.Scheduled = display.Bytes(capacity), display.Bytes(avail), display.Bytes(sched)
	if capacity > 0 {
		dr.Used = float64(capacity-avail) / float64(capacity)
		dr.ScheduledFrac = min(float64(sched)/float64(capacity), 1)
	}
	return dr
}

// rebuildRows are the rebuilds the engines of shown volumes report,
// sorted by volume and replica.
func rebuildRows(engs []v1.Engine, shown func(string) bool) []rebuildRow {
	var out []rebuildRow
	for _, e := range engs {
		if !shown(e.Spec.VolumeName) {
			continue
		}
		for rep, st := range e.Status.RebuildStatus {
			rr := rebuildRow{Volume: e.Spec.VolumeName, Replica: rep, Source: st.SourceReplica, State: string(st.State),
				Kind: "full", Done: display.Bytes(st.BytesDone), Total: display.Bytes(st.BytesTotal)}
			switch {
			case st.DirtyOnly:
				rr.Kind = "changed regions"
			case st.FullReason != "":
				rr.Kind = "full: " + st.FullReason
			}
			if st.BytesTotal > 0 {
				rr.Progress = float64(st.BytesDone) / float64(st.BytesTotal)
			}
			out = append(out, rr)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].Volume+out[i].Replica < out[j].Volume+out[j].Replica
	})
	return out
}

// eventRows are the namespace's 20 newest events, newest first; none
// without an events client or when they cannot be listed (logged at V(1)).
// maxBackupRows bounds the page's backup table: the newest ones.
const maxBackupRows = 50

// backupRows are the newest Backups of the shown volumes: state,
// progress, bytes uploaded, and when it completed or why it waits.
func backupRows(backups []v1.Backup, shown func(string) bool) []backupRow {
	sort.Slice(backups, func(i, j int) bool {
		if !backups[i].CreationTimestamp.Equal(&backups[j].CreationTimestamp) {
			return backups[j].CreationTimestamp.Before(&backups[i].CreationTimestamp)
		}
		return backups[i].Name < backups[j].Name
	})
	var out []backupRow
	for _, b := range backups {
		if !shown(b.Spec.Volume) {
			continue
		}
		st := b.Status.State
		if st == "" {
			st = v1.BackupStatePending
		}
		r := backupRow{Volume: b.Spec.Volume, Name: b.Name, Target: b.Spec.Target, State: string(st),
			Done: display.Bytes(b.Status.BytesDone), Total: display.Bytes(b.Status.BytesTotal), Uploaded: display.Bytes(b.Status.UploadedBytes),
			Detail: b.Status.Message}
		if b.Status.BytesTotal > 0 {
			r.Progress = float64(b.Status.BytesDone) / float64(b.Status.BytesTotal)
		}
		if st == v1.BackupStateCompleted {
			r.Progress = 1
			if t := b.Status.CompletionTime; t != nil {
				r.Detail = "completed " + t.UTC().Format(time.RFC3339)
			}
		}
		out = append(out, r)
		if len(out) == maxBackupRows {
			break
		}
	}
	return out
}

func (s *Server) eventRows(ctx context.Context, in client.InNamespace) []eventRow {
	if s.Events == nil {
		return nil
	}
	var evs corev1.EventList
	if err := s.Events.List(ctx, &evs, in); err != nil {
		s.Logger.V(1).Info("ui: events not listed", "error", err.Error())
	}
	sort.Slice(evs.Items, func(i, j int) bool { return display.EventTime(evs.Items[i]).After(display.EventTime(evs.Items[j])) })
	var out []eventRow
	for _, ev := range evs.Items[:min(len(evs.Items), 20)] {
		out = append(out, eventRow{Time: display.EventTime(ev).UTC().Format("15:04:05"), Type: ev.Type,
			Object: strings.ToLower(ev.InvolvedObject.Kind) + "/" + ev.InvolvedObject.Name, Reason: ev.Reason, Message: ev.Message})
	}
	return out
}

// claims maps each volume to its claim ("namespace/name"); none if the
// PersistentVolumes cannot be read (the page shows the rest).
func (s *Server) claims(ctx context.Context) map[string]string {
	out := map[string]string{}
	if s.Claims == nil {
		return out
	}
	byVolume, err := claims.List(ctx, s.Claims)
	if err != nil {
		s.Logger.V(1).Info("ui: claims not read", "error", err.Error())
		return out
	}
	for vol, ref := range byVolume {
		out[vol] = ref.String()
	}
	return out
}

// only resolves the ?volume= filter (a Volume's name, or a claim as
// NAMESPACE/NAME) to the volume to show alone. A filter that names no
// volume of the namespace gives a notice saying why (and every volume is
// shown); only a failed read of the API server is an error.
func (s *Server) only(ctx context.Context, filter string, vols []v1.Volume) (vol, notice string, err error) {
	if filter == "" {
		return "", "", nil
	}
	vol = filter
	if ref, ok := claims.ParseClaim(filter); ok {
		if s.Claims == nil {
			return "", "this page reads no claims: give the volume's name (the claim's spec.volumeName)", nil
		}
		vol, err = claims.VolumeOf(ctx, s.Claims, ref)
		if errors.Is(err, claims.ErrNoClaim) || errors.Is(err, claims.ErrNotBound) ||
			errors.Is(err, claims.ErrNoPersistentVolume) || errors.Is(err, claims.ErrOtherDriver) {
			return "", err.Error(), nil
		}
		if err != nil {
			return "", "", err
		}
	}
	for i := range vols {
		if vols[i].Name == vol {
			return vol, "", nil
		}
	}
	if vol != filter {
		return "", fmt.Sprintf("claim %s is bound to volume %s, which is not in namespace %s", filter, vol, s.Namespace), nil
	}
	return "", fmt.Sprintf("no volume %s in namespace %s (a claim is given as NAMESPACE/NAME)", filter, s.Namespace), nil
}

// volumeRows are the rows of the volumes shown, counting them by
// robustness into counts.
func volumeRows(vols []v1.Volume, engineOf map[string]*v1.Engine, hist map[types.NamespacedName]series, claimOf map[string]string,
	shown func(string) bool, counts map[string]int) []volumeRow {
	var out []volumeRow
	for _, v := range vols {
		if !shown(v.Name) {
			continue
		}
		row := volumeRow{Name: v.Name, State: string(v.Status.State), Robustness: string(v.Status.Robustness),
			Size: v.Spec.Size.String(), Node: v.Status.CurrentNodeName, Claim: claimOf[v.Name]}
		if v.Status.ActualSize != nil {
			row.Used = v.Status.ActualSize.String()
		}
		if row.Robustness == "" {
			row.Robustness = "unknown"
		}
		counts[row.Robustness]++
		if e := engineOf[v.Name]; e != nil {
			for _, m := range e.Status.ReplicaModeMap {
				if m == v1.ReplicaModeRW {
					row.RW++
				}
			}
			if h, ok := hist[types.NamespacedName{Namespace: e.Namespace, Name: e.Name}]; ok {
				row.Reads, row.Writes = spark(h.readRates), spark(h.writeRates)
			}
		}
		for _, c := range v.Status.Conditions {
			if c.Status != "True" && c.Message != "" && row.Message == "" && c.Type != v1.VolumeConditionRebuilding {
				row.Message = c.Message
			}
		}
		out = append(out, row)
	}
	return out
}
