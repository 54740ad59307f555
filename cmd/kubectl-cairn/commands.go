package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/claims"
	"github.com/cairn-io/cairn/controllers/display"
)

type options struct {
	c client.Client
	// kube and rest reach what the object client does not (logs, exec,
	// the server's version): support-bundle only.
	kube      kubernetes.Interface
	rest      *rest.Config
	out       io.Writer
	namespace string
	output    string
	watch     bool
	interval  time.Duration
	yes       bool
}

// emit writes v as JSON or YAML when asked; it reports whether it did.
func (o *options) emit(v any) (bool, error) {
	switch o.output {
	case "json":
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return true, err
		}
		_, err = fmt.Fprintln(o.out, string(b))
		return true, err
	case "yaml":
		b, err := yaml.Marshal(v)
		if err != nil {
			return true, err
		}
		_, err = o.out.Write(b)
		return true, err
	}
	return false, nil
}

// volumeView is a volume with its engine and replicas, as `volumes`
// prints it.
type volumeView struct {
	Name string `json:"name"`
	// Claim is the PersistentVolumeClaim (namespace/name) of the
	// volume's PersistentVolume, if it has one.
	Claim      string        `json:"claim,omitempty"`
	State      string        `json:"state"`
	Robustness string        `json:"robustness"`
	Size       string        `json:"size"`
	Used       string        `json:"used,omitempty"`
	Node       string        `json:"node,omitempty"`
	Engine     *engineView   `json:"engine,omitempty"`
	Replicas   []replicaView `json:"replicas"`
}

type engineView struct {
	Name  string `json:"name"`
	Node  string `json:"node,omitempty"`
	State string `json:"state"`
}

type replicaView struct {
	Name   string `json:"name"`
	Node   string `json:"node,omitempty"`
	Disk   string `json:"disk,omitempty"`
	State  string `json:"state"`
	Mode   string `json:"mode,omitempty"`
	Health string `json:"health"`
}

type objects struct {
	vols []v1.Volume
	engs []v1.Engine
	reps []v1.Replica
	// claimOf maps a volume to its claim; empty if the PersistentVolumes
	// cannot be read (the claim is then not shown).
	claimOf map[string]claims.Ref
}

// load lists the namespace's Volumes, Engines and Replicas (volumes and
// replicas sorted by name) and, when the PersistentVolumes can be read, the
// volumes' claims.
func (o *options) load(ctx context.Context) (*objects, error) {
	in := client.InNamespace(o.namespace)
	var vl v1.VolumeList
	var el v1.EngineList
	var rl v1.ReplicaList
	for _, l := range []client.ObjectList{&vl, &el, &rl} {
		if err := o.c.List(ctx, l, in); err != nil {
			return nil, fmt.Errorf("list %T in %s: %w", l, o.namespace, err)
		}
	}
	objs := &objects{vols: vl.Items, engs: el.Items, reps: rl.Items}
	objs.claimOf, _ = claims.List(ctx, o.c)
	sort.Slice(objs.vols, func(i, j int) bool { return objs.vols[i].Name < objs.vols[j].Name })
	sort.Slice(objs.reps, func(i, j int) bool { return objs.reps[i].Name < objs.reps[j].Name })
	return objs, nil
}

// engineOf is the volume's Engine (a volume has one), or nil.
func (objs *objects) engineOf(vol string) *v1.Engine {
	for i := range objs.engs {
		if objs.engs[i].Spec.VolumeName == vol {
			return &objs.engs[i]
		}
	}
	return nil
}

func (objs *objects) replicasOf(vol string) []v1.Replica {
	var out []v1.Replica
	for _, r := range objs.reps {
		if r.Spec.VolumeName == vol {
			out = append(out, r)
		}
	}
	return out
}

func view(objs *objects, v *v1.Volume) volumeView {
	vv := volumeView{Name: v.Name, State: orDash(string(v.Status.State)), Robustness: orDash(string(v.Status.Robustness)),
		Size: v.Spec.Size.String(), Node: v.Status.CurrentNodeName}
	if ref, ok := objs.claimOf[v.Name]; ok {
		vv.Claim = ref.String()
	}
	if v.Status.ActualSize != nil {
		vv.Used = v.Status.ActualSize.String()
	}
	e := objs.engineOf(v.Name)
	if e != nil {
		vv.Engine = &engineView{Name: e.Name, Node: e.Spec.NodeName, State: orDash(string(e.Status.InstanceState))}
	}
	for _, r := range objs.replicasOf(v.Name) {
		rv := replicaView{Name: r.Name, Node: r.Spec.NodeName, Disk: r.Spec.DiskName, State: orDash(string(r.Status.InstanceState))}
		if e != nil {
			rv.Mode = string(e.Status.ReplicaModeMap[r.Name])
		}
		rv.Health = replicaHealth(&r, rv.Mode)
		vv.Replicas = append(vv.Replicas, rv)
	}
	return vv
}

// replicaHealth says in a word how a replica is doing.
func replicaHealth(r *v1.Replica, mode string) string {
	switch {
	case r.Spec.NodeName == "":
		return "unscheduled"
	case mode == string(v1.ReplicaModeERR):
		return "failed"
	case mode == string(v1.ReplicaModeWO):
		return "rebuilding"
	case mode == string(v1.ReplicaModeRW):
		return "healthy"
	case r.Status.InstanceState == v1.InstanceStateRunning:
		return "running"
	case r.Status.InstanceState == v1.InstanceStateError || r.Status.InstanceState == v1.InstanceStateUnknown:
		return string(r.Status.InstanceState)
	}
	return "stopped"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func (o *options) volumes(ctx context.Context) error {
	objs, err := o.load(ctx)
	if err != nil {
		return err
	}
	views := make([]volumeView, 0, len(objs.vols))
	for i := range objs.vols {
		views = append(views, view(objs, &objs.vols[i]))
	}
	if done, err := o.emit(views); done {
		return err
	}
	if len(views) == 0 {
		fmt.Fprintf(o.out, "No volumes in %s.\n", o.namespace)
		return nil
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCLAIM\tSTATE\tROBUSTNESS\tSIZE\tUSED\tNODE\tMODE\tHEALTH")
	for _, v := range views {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t\t\n", v.Name, orDash(v.Claim), v.State, v.Robustness, v.Size, orDash(v.Used), orDash(v.Node))
		n := len(v.Replicas)
		if v.Engine != nil {
			branch := "├─"
			if n == 0 {
				branch = "└─"
			}
			fmt.Fprintf(tw, "%s engine/%s\t\t%s\t\t\t\t%s\t\t\n", branch, v.Engine.Name, v.Engine.State, orDash(v.Engine.Node))
		}
		for i, r := range v.Replicas {
			branch := "├─"
			if i == n-1 {
				branch = "└─"
			}
			fmt.Fprintf(tw, "%s replica/%s\t\t%s\t\t\t\t%s\t%s\t%s\n", branch, r.Name, r.State, orDash(r.Node), orDash(r.Mode), r.Health)
		}
	}
	return tw.Flush()
}

// rebuildView is one replica's rebuild.
type rebuildView struct {
	Volume     string  `json:"volume"`
	Replica    string  `json:"replica"`
	Source     string  `json:"source,omitempty"`
	State      string  `json:"state"`
	DirtyOnly  bool    `json:"dirtyOnly"`
	BytesDone  int64   `json:"bytesDone"`
	BytesTotal int64   `json:"bytesTotal"`
	Progress   float64 `json:"progress"`
}

func (o *options) rebuildViews(ctx context.Context) ([]rebuildView, error) {
	var el v1.EngineList
	if err := o.c.List(ctx, &el, client.InNamespace(o.namespace)); err != nil {
		return nil, fmt.Errorf("list engines in %s: %w", o.namespace, err)
	}
	var out []rebuildView
	for _, e := range el.Items {
		for rep, st := range e.Status.RebuildStatus {
			rv := rebuildView{Volume: e.Spec.VolumeName, Replica: rep, Source: st.SourceReplica, State: string(st.State),
				DirtyOnly: st.DirtyOnly, BytesDone: st.BytesDone, BytesTotal: st.BytesTotal}
			if st.BytesTotal > 0 {
				rv.Progress = float64(st.BytesDone) / float64(st.BytesTotal)
			}
			out = append(out, rv)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Volume+"/"+out[i].Replica < out[j].Volume+"/"+out[j].Replica })
	return out, nil
}

func bar(p float64, width int) string {
	p = min(max(p, 0), 1)
	n := int(p*float64(width) + 0.5)
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", width-n) + "]"
}

func (o *options) rebuilds(ctx context.Context) error {
	for {
		views, err := o.rebuildViews(ctx)
		if err != nil {
			return err
		}
		if done, err := o.emit(views); done {
			return err
		}
		active := 0
		tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "VOLUME\tREPLICA\tSOURCE\tKIND\tSTATE\tPROGRESS")
		for _, r := range views {
			kind := "full"
			if r.DirtyOnly {
				kind = "changed regions"
			}
			if r.State == string(v1.RebuildStateInProgress) {
				active++
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s %3.0f%% %s / %s\n", r.Volume, r.Replica, orDash(r.Source), kind, orDash(r.State),
				bar(r.Progress, 20), 100*r.Progress, display.Bytes(r.BytesDone), display.Bytes(r.BytesTotal))
		}
		if len(views) == 0 {
			fmt.Fprintf(o.out, "No rebuilds in %s.\n", o.namespace)
		} else if err := tw.Flush(); err != nil {
			return err
		}
		if !o.watch || active == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(o.interval):
		}
		fmt.Fprintln(o.out)
	}
}

type snapshotView struct {
	Name    string `json:"name"`
	Volume  string `json:"volume"`
	Ready   bool   `json:"readyToUse"`
	Size    string `json:"size,omitempty"`
	Created string `json:"created,omitempty"`
	Message string `json:"message,omitempty"`
}

func (o *options) snapshots(ctx context.Context, vol string) error {
	var sl v1.SnapshotList
	if err := o.c.List(ctx, &sl, client.InNamespace(o.namespace)); err != nil {
		return fmt.Errorf("list snapshots in %s: %w", o.namespace, err)
	}
	var views []snapshotView
	for _, s := range sl.Items {
		if vol != "" && s.Spec.Volume != vol {
			continue
		}
		sv := snapshotView{Name: s.Name, Volume: s.Spec.Volume, Ready: s.Status.ReadyToUse}
		if s.Status.Size != nil {
			sv.Size = s.Status.Size.String()
		}
		if s.Status.CreationTime != nil {
			sv.Created = s.Status.CreationTime.UTC().Format(time.RFC3339)
		}
		if c := meta.FindStatusCondition(s.Status.Conditions, v1.SnapshotConditionReady); c != nil && c.Status != metav1.ConditionTrue {
			sv.Message = c.Message
		}
		views = append(views, sv)
	}
	sort.Slice(views, func(i, j int) bool { return views[i].Volume+"/"+views[i].Name < views[j].Volume+"/"+views[j].Name })
	if done, err := o.emit(views); done {
		return err
	}
	if len(views) == 0 {
		fmt.Fprintf(o.out, "No snapshots in %s.\n", o.namespace)
		return nil
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tVOLUME\tREADY\tSIZE\tCREATED\tMESSAGE")
	for _, s := range views {
		fmt.Fprintf(tw, "%s\t%s\t%v\t%s\t%s\t%s\n", s.Name, s.Volume, s.Ready, orDash(s.Size), orDash(s.Created), s.Message)
	}
	return tw.Flush()
}

// finding is one thing doctor found wrong, with what to do.
type finding struct{ what, fix string }

// doctor explains why a volume is not attached or not healthy; it reports
// whether it found the volume healthy.
func (o *options) doctor(ctx context.Context, arg string) (bool, error) {
	name, claim, err := o.resolve(ctx, arg)
	if err != nil {
		return false, err
	}
	v, err := o.doctorVolume(ctx, name)
	if err != nil {
		return false, err
	}
	objs, err := o.load(ctx)
	if err != nil {
		return false, err
	}
	vv := view(objs, v)
	o.printVolumeLine(v, vv, claim)

	found := o.conditionFindings(v)
	found = append(found, volumeFindings(v, vv)...)
	e := objs.engineOf(v.Name)
	found = append(found, o.engineFindings(ctx, v, e)...)
	found = append(found, o.replicaFindings(ctx, objs, v, e)...)

	o.printWarnings(ctx, v)
	return o.printFindings(v, found), nil
}

// doctorVolume reads the volume doctor looks into, with a hint on how to
// name it when there is none.
func (o *options) doctorVolume(ctx context.Context, name string) (*v1.Volume, error) {
	v := &v1.Volume{}
	if err := o.c.Get(ctx, client.ObjectKey{Namespace: o.namespace, Name: name}, v); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("no volume %s in %s (for a claim, give NAMESPACE/CLAIM, such as `kubectl cairn doctor default/data`; or pass -n with the namespace Cairn runs in)", name, o.namespace)
		}
		return nil, err
	}
	return v, nil
}

// printVolumeLine prints the volume's name, claim, state, robustness,
// size and node on one line.
func (o *options) printVolumeLine(v *v1.Volume, vv volumeView, claim string) {
	fmt.Fprintf(o.out, "Volume %s", v.Name)
	if claim != "" {
		fmt.Fprintf(o.out, " (claim %s)", claim)
	}
	fmt.Fprintf(o.out, ": %s, %s, %s", vv.State, vv.Robustness, vv.Size)
	if vv.Node != "" {
		fmt.Fprintf(o.out, ", on %s", vv.Node)
	}
	fmt.Fprintln(o.out)
}

// volumeFindings are what the volume's own status says is wrong beyond its
// unmet conditions: a rebuild, an attachment not made, a fault.
func volumeFindings(v *v1.Volume, vv volumeView) []finding {
	var found []finding
	add := func(what, fix string) { found = append(found, finding{what, fix}) }
	if c := meta.FindStatusCondition(v.Status.Conditions, v1.VolumeConditionRebuilding); c != nil && c.Status == metav1.ConditionTrue {
		add("a replica is being rebuilt: "+c.Message, "nothing to do: `kubectl cairn rebuilds --watch` shows its progress")
	}
	if v.Spec.NodeName != "" && v.Status.State != v1.VolumeStateAttached {
		add("it should be attached to "+v.Spec.NodeName+" but is "+vv.State, "see the engine and replicas below")
	}
	if v.Status.Robustness == v1.VolumeRobustnessFaulted {
		add("faulted: no replica is usable",
			"bring back the nodes of the replicas that held data (their instance managers must run); the manager salvages the volume from the newest replica once they run (docs/control-plane.md, salvage)")
	}
	return found
}

// engineFindings say what is wrong with the volume's Engine e (nil if it
// has none).
func (o *options) engineFindings(ctx context.Context, v *v1.Volume, e *v1.Engine) []finding {
	switch {
	case e == nil && v.Spec.NodeName != "":
		return []finding{{"it has no Engine", "the manager creates it: check that cairn-manager runs (kubectl -n " + o.namespace + " logs deploy/cairn-manager)"}}
	case e != nil:
		if c := meta.FindStatusCondition(e.Status.Conditions, v1.ConditionReady); c != nil && c.Status != metav1.ConditionTrue && e.Spec.DesiredState == v1.DesiredInstanceStateRunning {
			return []finding{{"engine " + e.Name + " on " + orDash(e.Spec.NodeName) + " is not ready (" + c.Reason + "): " + c.Message, o.imFix(ctx, e.Status.InstanceManagerName, e.Spec.NodeName)}}
		}
	}
	return nil
}

// replicaFindings say what is wrong with each of the volume's replicas
// that should run, as its Engine e (nil if none) and its status see it.
func (o *options) replicaFindings(ctx context.Context, objs *objects, v *v1.Volume, e *v1.Engine) []finding {
	var found []finding
	add := func(what, fix string) { found = append(found, finding{what, fix}) }
	for _, r := range objs.replicasOf(v.Name) {
		mode := ""
		if e != nil {
			mode = string(e.Status.ReplicaModeMap[r.Name])
		}
		switch health := replicaHealth(&r, mode); health {
		case "healthy", "rebuilding":
		case "unscheduled":
			add("replica "+r.Name+" has no disk", "see Scheduled above")
		case "failed":
			add("replica "+r.Name+" on "+r.Spec.NodeName+" failed in the engine (ERR)",
				"the manager gives it back with a resync when its process runs again, or replaces it on another node after --replenishment-wait")
		default:
			if r.Spec.DesiredState != v1.DesiredInstanceStateRunning {
				continue
			}
			msg := ""
			if c := meta.FindStatusCondition(r.Status.Conditions, v1.ConditionReady); c != nil {
				msg = " (" + c.Reason + "): " + c.Message
			}
			add("replica "+r.Name+" on "+r.Spec.NodeName+" is "+health+msg, o.imFix(ctx, r.Status.InstanceManagerName, r.Spec.NodeName))
		}
	}
	return found
}

// printWarnings prints the volume's five newest Warning events, if the
// events can be read (they only help; the diagnosis stands without them).
func (o *options) printWarnings(ctx context.Context, v *v1.Volume) {
	var events corev1.EventList
	if err := o.c.List(ctx, &events, client.InNamespace(o.namespace)); err != nil {
		return
	}
	var warn []corev1.Event
	for _, ev := range events.Items {
		if ev.InvolvedObject.Name == v.Name && ev.Type == corev1.EventTypeWarning {
			warn = append(warn, ev)
		}
	}
	sort.Slice(warn, func(i, j int) bool { return display.EventTime(warn[i]).After(display.EventTime(warn[j])) })
	if len(warn) > 0 {
		fmt.Fprintln(o.out, "\nRecent warnings:")
		for _, ev := range warn[:min(len(warn), 5)] {
			fmt.Fprintf(o.out, "  %s  %s: %s\n", display.EventTime(ev).UTC().Format(time.RFC3339), ev.Reason, ev.Message)
		}
	}
}

// printFindings prints what doctor found, each with its fix, and reports
// whether the volume is healthy: nothing found, and healthy or detached.
func (o *options) printFindings(v *v1.Volume, found []finding) bool {
	if len(found) == 0 {
		fmt.Fprintln(o.out, "\nNothing wrong found.")
		return v.Status.Robustness == v1.VolumeRobustnessHealthy || v.Spec.NodeName == ""
	}
	fmt.Fprintln(o.out, "\nFound:")
	for i, f := range found {
		fmt.Fprintf(o.out, "%d. %s\n", i+1, f.what)
		if f.fix != "" {
			fmt.Fprintf(o.out, "   fix: %s\n", f.fix)
		}
	}
	return false
}

// conditionFindings are the volume's conditions that are not met, each
// with what to do (Rebuilding is reported on its own, Cloned only for a
// volume with a data source).
func (o *options) conditionFindings(v *v1.Volume) []finding {
	var found []finding
	add := func(what, fix string) { found = append(found, finding{what, fix}) }
	for _, c := range v.Status.Conditions {
		if c.Status == metav1.ConditionTrue || c.Type == v1.VolumeConditionRebuilding || c.Type == v1.VolumeConditionCloned && v.Spec.DataSource == nil {
			continue
		}
		switch c.Type {
		case v1.VolumeConditionScheduled:
			add("not every replica has a disk: "+c.Message,
				"add nodes or disks with room (kubectl -n "+o.namespace+" get storagenodes), lower numberOfReplicas, or relax the disk selector")
		case v1.VolumeConditionCloned:
			add("the copy from its data source is not complete: "+c.Message, "wait for it (the Cloned condition shows progress); it attaches once verified")
		default:
			add(c.Type+" is "+string(c.Status)+" ("+c.Reason+"): "+c.Message, "")
		}
	}
	return found
}

// resolve takes a Volume's name or a claim (NAMESPACE/NAME) and returns
// the Volume's name and its claim ("" if it has none, or the
// PersistentVolumes cannot be read).
func (o *options) resolve(ctx context.Context, arg string) (volume, claim string, err error) {
	if ref, ok := claims.ParseClaim(arg); ok {
		volume, err = claims.VolumeOf(ctx, o.c, ref)
		return volume, ref.String(), err
	}
	byVolume, err := claims.List(ctx, o.c)
	if err != nil {
		// The claim is shown when known; a user who may not list
		// PersistentVolumes still gets the diagnosis.
		return arg, "", nil
	}
	if ref, ok := byVolume[arg]; ok {
		claim = ref.String()
	}
	return arg, claim, nil
}

// imFix says what to check about a node's instance manager.
func (o *options) imFix(ctx context.Context, imName, node string) string {
	var ims v1.InstanceManagerList
	if err := o.c.List(ctx, &ims, client.InNamespace(o.namespace)); err != nil {
		return "check the instance manager on " + node
	}
	i := slices.IndexFunc(ims.Items, func(im v1.InstanceManager) bool {
		return im.Name == imName || imName == "" && im.Spec.NodeName == node
	})
	if i < 0 {
		return "no instance manager is known on " + node + ": is the node up, and its cairn-instance-manager pod running? (kubectl -n " + o.namespace + " get pods -o wide)"
	}
	im := ims.Items[i]
	if im.Status.State != v1.InstanceManagerStateRunning {
		return fmt.Sprintf("instance manager %s on %s is %s: is the node up and its pod ready? (kubectl -n %s get pods -o wide -l app.kubernetes.io/component=instance-manager)",
			im.Name, node, orDash(string(im.Status.State)), o.namespace)
	}
	return "its instance manager " + im.Name + " runs; the process's log is in the instance-manager pod on " + node + " under /var/lib/cairn/logs"
}

// salvage explains what a faulted volume's salvage waits for and, when
// told which replicas are lost for good (and --yes), deletes them so that
// the manager salvages from the others.
func (o *options) salvage(ctx context.Context, name string, giveUp []string) error {
	v := &v1.Volume{}
	if err := o.c.Get(ctx, client.ObjectKey{Namespace: o.namespace, Name: name}, v); err != nil {
		if apierrors.IsNotFound(err) {
			return fmt.Errorf("no volume %s in %s", name, o.namespace)
		}
		return err
	}
	if v.Status.Robustness != v1.VolumeRobustnessFaulted {
		fmt.Fprintf(o.out, "Volume %s is %s, not faulted: nothing to salvage.\n", name, orDash(string(v.Status.Robustness)))
		if len(giveUp) > 0 {
			return fmt.Errorf("refusing to delete replicas of a volume that is not faulted")
		}
		return nil
	}
	objs, err := o.load(ctx)
	if err != nil {
		return err
	}
	reps := objs.replicasOf(name)
	fmt.Fprintf(o.out, "Volume %s is faulted: no replica is RW. The manager salvages it once every replica that may hold\n"+
		"the newest data runs again, keeping the replicas with the newest epoch.\n\n", name)
	if c := meta.FindStatusCondition(v.Status.Conditions, v1.ConditionReady); c != nil && c.Message != "" {
		fmt.Fprintf(o.out, "Ready: %s\n\n", c.Message)
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REPLICA\tNODE\tSTATE\tINSTANCE MANAGER")
	var down []string
	for _, r := range reps {
		im := "-"
		if r.Spec.NodeName != "" {
			im = o.imState(ctx, r.Status.InstanceManagerName, r.Spec.NodeName)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.Name, orDash(r.Spec.NodeName), orDash(string(r.Status.InstanceState)), im)
		if r.Status.InstanceState != v1.InstanceStateRunning {
			down = append(down, r.Name)
		}
	}
	tw.Flush()
	if len(giveUp) == 0 {
		if len(down) == 0 {
			fmt.Fprintln(o.out, "\nEvery replica runs: the salvage is under way.")
			return nil
		}
		fmt.Fprintf(o.out, "\nBring back the nodes of %s if you can. If a disk is lost for good, give up on its replica:\n"+
			"  kubectl cairn salvage %s --give-up %s --yes\n"+
			"Its data is deleted; if it held the newest writes, those are lost.\n", strings.Join(down, ", "), name, strings.Join(down, ","))
		return nil
	}
	known := map[string]bool{}
	for _, r := range reps {
		known[r.Name] = true
	}
	for _, g := range giveUp {
		if !known[g] {
			return fmt.Errorf("%s is not a replica of %s", g, name)
		}
	}
	if len(giveUp) == len(reps) {
		return fmt.Errorf("refusing to give up on every replica of %s: nothing would be left to salvage from", name)
	}
	if !o.yes {
		fmt.Fprintf(o.out, "\nWould delete %s (and its data). Run again with --yes to do it.\n", strings.Join(giveUp, ", "))
		return nil
	}
	for _, g := range giveUp {
		r := &v1.Replica{}
		r.Namespace, r.Name = o.namespace, g
		if err := o.c.Delete(ctx, r); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete replica %s: %w", g, err)
		}
		fmt.Fprintf(o.out, "\nreplica %s deleted", g)
	}
	fmt.Fprintf(o.out, "\nThe manager salvages %s from the remaining replicas once they run; `kubectl cairn doctor %s` follows it.\n", name, name)
	return nil
}

// imState says in a few words how a node's instance manager is.
func (o *options) imState(ctx context.Context, imName, node string) string {
	var ims v1.InstanceManagerList
	if err := o.c.List(ctx, &ims, client.InNamespace(o.namespace)); err != nil {
		return "?"
	}
	for _, im := range ims.Items {
		if im.Name == imName || imName == "" && im.Spec.NodeName == node {
			return im.Name + " " + orDash(string(im.Status.State))
		}
	}
	return "none on " + node
}
