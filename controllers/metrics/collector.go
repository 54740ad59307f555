// Package metrics exposes Cairn to Prometheus: each volume's I/O (operations,
// bytes, errors and latency, read from its engine), robustness, state,
// size and rebuild progress, each replica's mode, each disk's space and
// each instance manager's processes. Everything is read when Prometheus
// scrapes, from the manager's cache and from the running engines, so the
// figures are never older than the scrape and nothing is kept between
// scrapes. The manager registers the Collector with controller-runtime's
// registry, served on its metrics endpoint (--metrics-bind-address).
package metrics

import (
	"context"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/engine"
	enginev1 "github.com/cairn-io/cairn/dataplane/api/engine/v1"
)

// Engines are the running engines the manager follows
// (engine.Watches).
type Engines interface {
	Each(fn func(key types.NamespacedName, c *engine.Conn))
}

// Collector is a prometheus.Collector over Cairn's objects and engines.
type Collector struct {
	// Client reads the objects (the manager's cached client).
	Client client.Reader
	// Engines gives the running engines; nil: no I/O metrics.
	Engines func() Engines
	// Timeout bounds one scrape's calls to the engines (default 3 s); an
	// engine that does not answer in time is left out of that scrape.
	Timeout time.Duration
	Logger  logr.Logger
}

var (
	volLabels = []string{"namespace", "volume"}

	descOps = prometheus.NewDesc("cairn_volume_operations_total",
		"Operations the volume's engine completed, by operation (read, write, flush, unmap).", append(volLabels, "op"), nil)
	descBytes = prometheus.NewDesc("cairn_volume_operation_bytes_total",
		"Bytes the volume's engine read or wrote, by operation.", append(volLabels, "op"), nil)
	descErrors = prometheus.NewDesc("cairn_volume_operation_errors_total",
		"Operations the volume's engine failed to its client, by operation.", append(volLabels, "op"), nil)
	descLatency = prometheus.NewDesc("cairn_volume_operation_duration_seconds",
		"Latency of the volume's operations as its engine measured them, by operation.", append(volLabels, "op"), nil)
	descSize = prometheus.NewDesc("cairn_volume_size_bytes",
		"The volume's size.", volLabels, nil)
	descActual = prometheus.NewDesc("cairn_volume_actual_size_bytes",
		"Space the volume's data takes on disk in its largest replica.", volLabels, nil)
	descRobustness = prometheus.NewDesc("cairn_volume_robustness",
		"1 for the volume's robustness (healthy, degraded, faulted, unknown), 0 for the others.", append(volLabels, "robustness"), nil)
	descState = prometheus.NewDesc("cairn_volume_state",
		"1 for the volume's state (creating, detached, attaching, attached, detaching, deleting), 0 for the others.", append(volLabels, "state"), nil)
	descRebuildDone = prometheus.NewDesc("cairn_volume_rebuild_bytes_done",
		"Bytes copied so far to a replica being rebuilt.", append(volLabels, "replica"), nil)
	descRebuildTotal = prometheus.NewDesc("cairn_volume_rebuild_bytes_total",
		"Bytes a replica's rebuild copies in all.", append(volLabels, "replica"), nil)
	descReplicaMode = prometheus.NewDesc("cairn_replica_mode",
		"1 for the replica's mode in its engine (RW, WO, ERR), 0 for the others.", append(volLabels, "replica", "mode"), nil)
	diskLabels       = []string{"node", "disk"}
	descDiskCapacity = prometheus.NewDesc("cairn_disk_capacity_bytes",
		"A node's disk's capacity.", diskLabels, nil)
	descDiskAvailable = prometheus.NewDesc("cairn_disk_available_bytes",
		"A node's disk's free space.", diskLabels, nil)
	descDiskScheduled = prometheus.NewDesc("cairn_disk_scheduled_bytes",
		"The sizes of the replicas scheduled on a node's disk, added up.", diskLabels, nil)
	descProcesses = prometheus.NewDesc("cairn_instance_manager_processes",
		"Processes an instance manager runs, by kind and state.", []string{"instance_manager", "node", "kind", "state"}, nil)
)

var (
	robustnesses = []v1.VolumeRobustness{v1.VolumeRobustnessHealthy, v1.VolumeRobustnessDegraded, v1.VolumeRobustnessFaulted, v1.VolumeRobustnessUnknown}
	states       = []v1.VolumeState{v1.VolumeStateCreating, v1.VolumeStateDetached, v1.VolumeStateAttaching, v1.VolumeStateAttached,
		v1.VolumeStateDetaching, v1.VolumeStateDeleting}
	modes = []v1.ReplicaMode{v1.ReplicaModeRW, v1.ReplicaModeWO, v1.ReplicaModeERR}
)

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descOps, descBytes, descErrors, descLatency, descSize, descActual, descRobustness,
		descState, descRebuildDone, descRebuildTotal, descReplicaMode, descDiskCapacity, descDiskAvailable, descDiskScheduled, descProcesses} {
		ch <- d
	}
	for _, d := range backupDescs {
		ch <- d
	}
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func bool01(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Collect implements prometheus.Collector: each kind is listed and turned
// into gauges; a list that fails is logged and its gauges left out.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = 3 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()

	c.collectVolumes(ctx, ch)
	volumeOf := c.collectEngines(ctx, ch)
	c.collectDisks(ctx, ch)
	c.collectProcesses(ctx, ch)
	c.collectBackups(ctx, ch)
	if c.Engines != nil {
		if es := c.Engines(); es != nil {
			c.collectIO(ctx, es, volumeOf, ch)
		}
	}
}

// collectVolumes: each Volume's size, actual size, robustness and state.
func (c *Collector) collectVolumes(ctx context.Context, ch chan<- prometheus.Metric) {
	var vols v1.VolumeList
	if err := c.Client.List(ctx, &vols); err != nil {
		c.Logger.Error(err, "metrics: list volumes")
	}
	for _, v := range vols.Items {
		ns, name := v.Namespace, v.Name
		if v.Status.Size != nil {
			gauge(ch, descSize, float64(v.Status.Size.Value()), ns, name)
		} else {
			gauge(ch, descSize, float64(v.Spec.Size.Value()), ns, name)
		}
		if v.Status.ActualSize != nil {
			gauge(ch, descActual, float64(v.Status.ActualSize.Value()), ns, name)
		}
		rob := v.Status.Robustness
		if rob == "" {
			rob = v1.VolumeRobustnessUnknown
		}
		for _, r := range robustnesses {
			gauge(ch, descRobustness, bool01(r == rob), ns, name, string(r))
		}
		for _, s := range states {
			gauge(ch, descState, bool01(s == v.Status.State), ns, name, string(s))
		}
	}
}

// collectEngines: each rebuild's progress and each replica's mode, by
// volume; it returns the volume of each Engine, for the I/O counters.
func (c *Collector) collectEngines(ctx context.Context, ch chan<- prometheus.Metric) map[types.NamespacedName]string {
	var engines v1.EngineList
	if err := c.Client.List(ctx, &engines); err != nil {
		c.Logger.Error(err, "metrics: list engines")
	}
	volumeOf := map[types.NamespacedName]string{}
	for _, e := range engines.Items {
		ns, vol := e.Namespace, e.Spec.VolumeName
		volumeOf[types.NamespacedName{Namespace: ns, Name: e.Name}] = vol
		for rep, st := range e.Status.RebuildStatus {
			gauge(ch, descRebuildDone, float64(st.BytesDone), ns, vol, rep)
			gauge(ch, descRebuildTotal, float64(st.BytesTotal), ns, vol, rep)
		}
		for rep, mode := range e.Status.ReplicaModeMap {
			for _, m := range modes {
				gauge(ch, descReplicaMode, bool01(m == mode), ns, vol, rep, string(m))
			}
		}
	}
	return volumeOf
}

// collectDisks: each StorageNode disk's capacity, free and scheduled bytes.
func (c *Collector) collectDisks(ctx context.Context, ch chan<- prometheus.Metric) {
	var nodes v1.StorageNodeList
	if err := c.Client.List(ctx, &nodes); err != nil {
		c.Logger.Error(err, "metrics: list storage nodes")
	}
	for _, n := range nodes.Items {
		node := n.Spec.NodeName
		if node == "" {
			node = n.Name
		}
		for _, d := range n.Status.Disks {
			if d.Capacity != nil {
				gauge(ch, descDiskCapacity, float64(d.Capacity.Value()), node, d.Name)
			}
			if d.Available != nil {
				gauge(ch, descDiskAvailable, float64(d.Available.Value()), node, d.Name)
			}
			if d.Scheduled != nil {
				gauge(ch, descDiskScheduled, float64(d.Scheduled.Value()), node, d.Name)
			}
		}
	}
}

// collectProcesses: each instance manager's processes, counted by kind
// and state.
func (c *Collector) collectProcesses(ctx context.Context, ch chan<- prometheus.Metric) {
	var ims v1.InstanceManagerList
	if err := c.Client.List(ctx, &ims); err != nil {
		c.Logger.Error(err, "metrics: list instance managers")
	}
	for _, im := range ims.Items {
		type kindState struct{ kind, state string }
		count := map[kindState]int{}
		for _, p := range im.Status.Processes {
			count[kindState{string(p.Kind), string(p.State)}]++
		}
		for ks, n := range count {
			gauge(ch, descProcesses, float64(n), im.Name, im.Spec.NodeName, ks.kind, ks.state)
		}
	}
}

// Poll asks every running engine for its counters, all at once, and
// returns the answers by Engine; an engine that does not answer before ctx
// ends is left out (logged at V(1)).
func Poll(ctx context.Context, es Engines, log logr.Logger) map[types.NamespacedName]*enginev1.MetricsResponse {
	var mu sync.Mutex
	out := map[types.NamespacedName]*enginev1.MetricsResponse{}
	var wg sync.WaitGroup
	es.Each(func(key types.NamespacedName, conn *engine.Conn) {
		wg.Go(func() {
			m, err := conn.Client.Metrics(ctx, &enginev1.MetricsRequest{})
			if err != nil {
				log.V(1).Info("engine did not answer for its metrics", "engine", key.String(), "error", err.Error())
				return
			}
			mu.Lock()
			out[key] = m
			mu.Unlock()
		})
	})
	wg.Wait()
	return out
}

// collectIO emits every running engine's counters.
func (c *Collector) collectIO(ctx context.Context, es Engines, volumeOf map[types.NamespacedName]string, ch chan<- prometheus.Metric) {
	for key, m := range Poll(ctx, es, c.Logger) {
		vol, ok := volumeOf[key]
		if !ok {
			continue
		}
		bounds := m.GetLatencyBoundsNs()
		for op, om := range map[string]*enginev1.OpMetrics{"read": m.GetRead(), "write": m.GetWrite(), "flush": m.GetFlush(), "unmap": m.GetUnmap()} {
			labels := []string{key.Namespace, vol, op}
			ch <- prometheus.MustNewConstMetric(descOps, prometheus.CounterValue, float64(om.GetOps()), labels...)
			ch <- prometheus.MustNewConstMetric(descBytes, prometheus.CounterValue, float64(om.GetBytes()), labels...)
			ch <- prometheus.MustNewConstMetric(descErrors, prometheus.CounterValue, float64(om.GetErrors()), labels...)
			if h, ok := histogram(bounds, om.GetLatency(), labels); ok {
				ch <- h
			}
		}
	}
}

// histogram turns the engine's latency buckets (a count per bucket, the
// last one unbounded) into a Prometheus histogram (cumulative counts by
// upper bound in seconds). The sum is estimated from each bucket's upper
// bound (the engine keeps no sum), an overestimate of at most one bucket
// width per operation.
func histogram(boundsNs []int64, counts []uint64, labels []string) (prometheus.Metric, bool) {
	if len(counts) != len(boundsNs)+1 {
		return nil, false
	}
	buckets := make(map[float64]uint64, len(boundsNs))
	var cum uint64
	var sum float64
	for i, b := range boundsNs {
		cum += counts[i]
		sec := float64(b) / 1e9
		buckets[sec] = cum
		sum += float64(counts[i]) * sec
	}
	total := cum + counts[len(boundsNs)]
	if len(boundsNs) > 0 {
		sum += float64(counts[len(boundsNs)]) * float64(boundsNs[len(boundsNs)-1]) / 1e9
	}
	m, err := prometheus.NewConstHistogram(descLatency, total, sum, buckets, labels...)
	return m, err == nil
}
