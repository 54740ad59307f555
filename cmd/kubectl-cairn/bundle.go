package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/claims"
)

// maxLogBytes bounds each container log in the bundle (its newest part).
const maxLogBytes = 16 << 20

// execTimeout bounds each command run in a node's pod.
const execTimeout = 30 * time.Second

// bundle is a support bundle being written: a tar.gz of files, and the
// notes on what could not be collected (NOTES.txt, written last).
type bundle struct {
	o      *options
	tw     *tar.Writer
	now    time.Time
	stderr io.Writer
	notes  []string
}

// nodeCommands are what the bundle runs in each node's Cairn pods, by
// pod component label and container: the mounts the node plugin sees,
// the loop and nbd devices, the space on the replicas' disk, and the
// processes the instance manager's container really runs (its engines
// and replicas are its children). They run in the images' Debian userland
// (util-linux, coreutils, mawk; there is no ps); a missing tool says so
// in its output and the rest still runs.
var nodeCommands = []struct {
	component, container, file, script string
}{
	{"csi-node", "csi", "mounts.txt", "cat /proc/self/mountinfo"},
	{"csi-node", "csi", "block-devices.txt",
		"losetup --list --noheadings 2>&1; echo; for d in /sys/block/nbd*; do [ -e \"$d/pid\" ] && echo \"$d pid $(cat $d/pid) size $(cat $d/size) sectors\"; done; echo; lsblk 2>&1"},
	{"instance-manager", "instance-manager", "disk-usage.txt",
		"df -h /var/lib/cairn/replicas /var/lib/cairn/logs 2>&1; echo; du -sh /var/lib/cairn/replicas/* 2>&1; echo; ls -la /var/lib/cairn/logs 2>&1"},
	{"instance-manager", "instance-manager", "processes.txt", processListScript},
}

// processListScript lists the container's processes (not the shell that
// lists them) from /proc: pid, parent pid, resident KiB and command line.
// Command lines hold no secret: the instance manager hands its children
// keys through file descriptors, never in arguments.
const processListScript = `echo "PID PPID RSS_KB COMMAND"
for d in /proc/[0-9]*; do
  [ "${d#/proc/}" = "$$" ] && continue
  c=$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null); [ -n "$c" ] || continue
  echo "${d#/proc/} $(awk '$1=="PPid:"{p=$2} $1=="VmRSS:"{r=$2} END{print p, (r=="" ? "-" : r)}' "$d/status" 2>/dev/null) $c"
done`

// supportBundle writes the archive to file ("" picks a name in the
// current directory) and reports progress on stderr.
func (o *options) supportBundle(ctx context.Context, file string, stderr io.Writer) error {
	now := time.Now().UTC()
	if file == "" {
		file = "cairn-support-" + now.Format("20060102-150405") + ".tar.gz"
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("support-bundle: %w (give another FILE)", err)
	}
	gz := gzip.NewWriter(f)
	b := &bundle{o: o, tw: tar.NewWriter(gz), now: now, stderr: stderr}
	err = b.collect(ctx)
	for _, c := range []io.Closer{b.tw, gz, f} {
		if cerr := c.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}
	if err != nil {
		os.Remove(file)
		return err
	}
	fmt.Fprintf(stderr, "support-bundle: wrote %s (%d things could not be collected: see NOTES.txt in it)\n", file, len(b.notes))
	fmt.Fprintln(o.out, file)
	return nil
}

func (b *bundle) progress(format string, args ...any) {
	fmt.Fprintf(b.stderr, "support-bundle: "+format+"\n", args...)
}

// note records something that could not be collected.
func (b *bundle) note(format string, args ...any) {
	b.notes = append(b.notes, fmt.Sprintf(format, args...))
}

func (b *bundle) write(name string, data []byte) error {
	hdr := &tar.Header{Name: "cairn-support/" + name, Mode: 0o600, Size: int64(len(data)), ModTime: b.now, Typeflag: tar.TypeReg}
	if err := b.tw.WriteHeader(hdr); err != nil {
		return err
	}
	_, err := b.tw.Write(data)
	return err
}

// collect gathers everything; only a failure to write the archive is an
// error, a part that cannot be read is a note.
func (b *bundle) collect(ctx context.Context) error {
	steps := []struct {
		what string
		fn   func(context.Context) error
	}{
		{"versions", b.versions},
		{"Cairn objects", b.cairnObjects},
		{"storage objects of " + claims.DriverName, b.storageObjects},
		{"nodes and Cairn's pods", b.podsAndNodes},
		{"events", b.events},
		{"instance-manager processes", b.processes},
		{"pod logs", b.logs},
		{"mounts, loop/nbd devices, disk usage and processes on each node", b.nodeState},
	}
	for _, s := range steps {
		b.progress("%s", s.what)
		if err := s.fn(ctx); err != nil {
			return err
		}
	}
	return b.write("NOTES.txt", []byte(b.notesText()))
}

func (b *bundle) notesText() string {
	var s strings.Builder
	fmt.Fprintf(&s, "Cairn support bundle, %s, namespace %s.\n", b.now.Format(time.RFC3339), b.o.namespace)
	s.WriteString("No Secret is collected: not Cairn's CA, not the volumes' encryption passphrases, not any other.\n")
	s.WriteString("Files: versions.yaml; objects/ (Cairn's objects, and the PersistentVolumes, claims, VolumeAttachments,\n" +
		"StorageClasses, CSIDriver and CSINodes of " + claims.DriverName + "; nodes; the pods, Deployments and DaemonSets of the\n" +
		"namespace); events/; processes/ (each instance manager's processes, from its InstanceManager status);\n" +
		"logs/ (every container of every pod of the namespace, current and previous run; containers.txt: which logs are\n" +
		"here, and which containers never restarted and so have no previous log); nodes/ (run in each node's Cairn pods:\n" +
		"mounts, loop and nbd devices, disk usage, the instance manager's processes from /proc).\n")
	if len(b.notes) == 0 {
		s.WriteString("\nEverything was collected.\n")
		return s.String()
	}
	s.WriteString("\nNot collected:\n")
	for _, n := range b.notes {
		s.WriteString("- " + n + "\n")
	}
	return s.String()
}

// versions: this plugin's, the API server's, and what each Cairn pod
// and instance manager runs.
func (b *bundle) versions(ctx context.Context) error {
	out := map[string]any{"bundleTime": b.now.Format(time.RFC3339), "namespace": b.o.namespace}
	if bi, ok := debug.ReadBuildInfo(); ok {
		plugin := map[string]string{"go": bi.GoVersion, "module": bi.Main.Version}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" || s.Key == "vcs.time" || s.Key == "vcs.modified" {
				plugin[s.Key] = s.Value
			}
		}
		out["kubectl-cairn"] = plugin
	}
	if b.o.kube != nil {
		if v, err := b.o.kube.Discovery().ServerVersion(); err == nil {
			out["kubernetes"] = v.String()
		} else {
			b.note("the API server's version: %v", err)
		}
	}
	var ims v1.InstanceManagerList
	if err := b.o.c.List(ctx, &ims, client.InNamespace(b.o.namespace)); err == nil {
		im := map[string]string{}
		for _, i := range ims.Items {
			im[i.Name] = fmt.Sprintf("node %s, version %s, image %s, %s", i.Spec.NodeName, orDash(i.Status.Version), orDash(i.Spec.Image), orDash(string(i.Status.State)))
		}
		out["instanceManagers"] = im
	}
	var pods corev1.PodList
	if err := b.o.c.List(ctx, &pods, client.InNamespace(b.o.namespace)); err == nil {
		images := map[string][]string{}
		for _, p := range pods.Items {
			for _, c := range append(p.Spec.InitContainers, p.Spec.Containers...) {
				images[p.Name] = append(images[p.Name], c.Name+"="+c.Image)
			}
		}
		out["podImages"] = images
	}
	return b.yaml("versions.yaml", out)
}

func (b *bundle) yaml(name string, v any) error {
	data, err := yaml.Marshal(v)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return b.write(name, data)
}

// list lists objects of list's kind (in namespace, or everywhere if ""),
// drops managedFields and keeps those keep passes (nil: all); a list
// that fails is a note (ok false). It returns the items kept.
func (b *bundle) list(ctx context.Context, name string, list client.ObjectList, namespace string, keep func(runtime.Object) bool) (kept []runtime.Object, ok bool) {
	var opts []client.ListOption
	if namespace != "" {
		opts = append(opts, client.InNamespace(namespace))
	}
	if err := b.o.c.List(ctx, list, opts...); err != nil {
		b.note("%s: %v", name, err)
		return nil, false
	}
	items, err := meta.ExtractList(list)
	if err != nil {
		b.note("%s: %v", name, err)
		return nil, false
	}
	kept = []runtime.Object{}
	for _, it := range items {
		if keep != nil && !keep(it) {
			continue
		}
		if m, err := meta.Accessor(it); err == nil {
			m.SetManagedFields(nil)
		}
		kept = append(kept, it)
	}
	return kept, true
}

func (b *bundle) save(ctx context.Context, name string, list client.ObjectList, namespace string, keep func(runtime.Object) bool) ([]runtime.Object, error) {
	items, ok := b.list(ctx, name, list, namespace, keep)
	if !ok {
		return nil, nil
	}
	return items, b.yaml("objects/"+name+".yaml", items)
}

// cairnObjects: every object of Cairn's kinds, in every namespace.
func (b *bundle) cairnObjects(ctx context.Context) error {
	for name, l := range map[string]client.ObjectList{
		"volumes": &v1.VolumeList{}, "engines": &v1.EngineList{}, "replicas": &v1.ReplicaList{},
		"instancemanagers": &v1.InstanceManagerList{}, "storagenodes": &v1.StorageNodeList{}, "snapshots": &v1.SnapshotList{},
		"backups": &v1.BackupList{}, "backuptargets": &v1.BackupTargetList{}, "recurringjobs": &v1.RecurringJobList{},
	} {
		if _, err := b.save(ctx, name, l, "", nil); err != nil {
			return err
		}
	}
	return nil
}

// storageObjects: the PersistentVolumes of Cairn's driver, their claims,
// VolumeAttachments, StorageClasses, the CSIDriver and CSINodes.
func (b *bundle) storageObjects(ctx context.Context) error {
	ours := func(o runtime.Object) bool {
		csi := o.(*corev1.PersistentVolume).Spec.CSI
		return csi != nil && csi.Driver == claims.DriverName
	}
	pvs, err := b.save(ctx, "persistentvolumes", &corev1.PersistentVolumeList{}, "", ours)
	if err != nil {
		return err
	}
	names := map[string]bool{}
	for _, pv := range pvs {
		names[pv.(*corev1.PersistentVolume).Name] = true
	}
	if _, err := b.save(ctx, "persistentvolumeclaims", &corev1.PersistentVolumeClaimList{}, "", func(o runtime.Object) bool {
		return names[o.(*corev1.PersistentVolumeClaim).Spec.VolumeName]
	}); err != nil {
		return err
	}
	for name, l := range map[string]struct {
		list client.ObjectList
		keep func(runtime.Object) bool
	}{
		"volumeattachments": {&storagev1.VolumeAttachmentList{}, func(o runtime.Object) bool { return o.(*storagev1.VolumeAttachment).Spec.Attacher == claims.DriverName }},
		"storageclasses":    {&storagev1.StorageClassList{}, func(o runtime.Object) bool { return o.(*storagev1.StorageClass).Provisioner == claims.DriverName }},
		"csidrivers":        {&storagev1.CSIDriverList{}, func(o runtime.Object) bool { return o.(*storagev1.CSIDriver).Name == claims.DriverName }},
		"csinodes":          {&storagev1.CSINodeList{}, nil},
	} {
		if _, err := b.save(ctx, name, l.list, "", l.keep); err != nil {
			return err
		}
	}
	return nil
}

func (b *bundle) podsAndNodes(ctx context.Context) error {
	if _, err := b.save(ctx, "nodes", &corev1.NodeList{}, "", nil); err != nil {
		return err
	}
	for name, l := range map[string]client.ObjectList{"pods": &corev1.PodList{}, "deployments": &appsv1.DeploymentList{}, "daemonsets": &appsv1.DaemonSetList{}} {
		if _, err := b.save(ctx, name, l, b.o.namespace, nil); err != nil {
			return err
		}
	}
	return nil
}

// events: the namespace's, and those about the claims of Cairn's
// volumes, as a table (oldest first) and in full.
func (b *bundle) events(ctx context.Context) error {
	var pvcs corev1.PersistentVolumeClaimList
	namespaces := map[string]bool{b.o.namespace: true}
	if err := b.o.c.List(ctx, &pvcs); err == nil {
		for _, c := range pvcs.Items {
			namespaces[c.Namespace] = true
		}
	}
	nss := make([]string, 0, len(namespaces))
	for ns := range namespaces {
		nss = append(nss, ns)
	}
	sort.Strings(nss)
	for _, ns := range nss {
		keep := func(runtime.Object) bool { return true }
		if ns != b.o.namespace {
			keep = func(o runtime.Object) bool {
				k := o.(*corev1.Event).InvolvedObject.Kind
				return k == "PersistentVolumeClaim" || k == "Pod"
			}
		}
		items, _ := b.list(ctx, "events in "+ns, &corev1.EventList{}, ns, keep)
		if len(items) == 0 {
			continue
		}
		if err := b.write("events/"+ns+".txt", eventTable(items)); err != nil {
			return err
		}
		if err := b.yaml("events/"+ns+".yaml", items); err != nil {
			return err
		}
	}
	return nil
}

func eventTable(items []runtime.Object) []byte {
	evs := make([]*corev1.Event, 0, len(items))
	for _, it := range items {
		evs = append(evs, it.(*corev1.Event))
	}
	sort.Slice(evs, func(i, j int) bool { return eventTime(evs[i]).Before(eventTime(evs[j])) })
	var buf bytes.Buffer
	tw := tabwriter.NewWriter(&buf, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "LAST SEEN\tTYPE\tREASON\tOBJECT\tCOUNT\tMESSAGE")
	for _, e := range evs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s/%s\t%d\t%s\n", eventTime(e).UTC().Format(time.RFC3339), e.Type, e.Reason,
			strings.ToLower(e.InvolvedObject.Kind), e.InvolvedObject.Name, max(e.Count, 1), e.Message)
	}
	tw.Flush()
	return buf.Bytes()
}

func eventTime(e *corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}

// processes: each instance manager's process list, as its
// InstanceManager's status reports it.
func (b *bundle) processes(ctx context.Context) error {
	var ims v1.InstanceManagerList
	if err := b.o.c.List(ctx, &ims); err != nil {
		b.note("instance managers: %v", err)
		return nil
	}
	for _, im := range ims.Items {
		var buf bytes.Buffer
		fmt.Fprintf(&buf, "instance manager %s on node %s: %s, version %s, address %s\n\n", im.Name, im.Spec.NodeName,
			orDash(string(im.Status.State)), orDash(im.Status.Version), orDash(im.Spec.Address))
		tw := tabwriter.NewWriter(&buf, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "PROCESS\tKIND\tSTATE\tPORTS\tEXIT\tERROR")
		for _, p := range im.Status.Processes {
			exit := "-"
			if p.ExitCode != nil {
				exit = fmt.Sprint(*p.ExitCode)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%s\t%s\n", p.Name, orDash(string(p.Kind)), orDash(string(p.State)), p.Ports, exit, p.Error)
		}
		tw.Flush()
		if err := b.write("processes/"+orDash(im.Spec.NodeName)+"_"+im.Name+".txt", buf.Bytes()); err != nil {
			return err
		}
	}
	return nil
}

// logs: every container of every pod of the namespace, the current run
// and the previous one (if it restarted), and logs/containers.txt, which
// says for each container how often it restarted and which of its logs
// the bundle holds: a container that never restarted has no previous
// log, and the index says so.
func (b *bundle) logs(ctx context.Context) error {
	if b.o.kube == nil {
		b.note("pod logs: no connection to the API server for logs")
		return nil
	}
	var pods corev1.PodList
	if err := b.o.c.List(ctx, &pods, client.InNamespace(b.o.namespace)); err != nil {
		b.note("pods of %s: %v", b.o.namespace, err)
		return nil
	}
	var index bytes.Buffer
	tw := tabwriter.NewWriter(&index, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POD\tNODE\tCONTAINER\tRESTARTS\tCURRENT\tPREVIOUS")
	for _, p := range pods.Items {
		restarts := map[string]int32{}
		for _, st := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			restarts[st.Name] = st.RestartCount
		}
		for _, c := range append(p.Spec.InitContainers, p.Spec.Containers...) {
			current, err := b.log(ctx, &p, c.Name, false)
			if err != nil {
				return err
			}
			previous := "none: not restarted"
			if restarts[c.Name] > 0 {
				if previous, err = b.log(ctx, &p, c.Name, true); err != nil {
					return err
				}
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", p.Name, orDash(p.Spec.NodeName), c.Name, restarts[c.Name], current, previous)
		}
	}
	tw.Flush()
	return b.write("logs/containers.txt", index.Bytes())
}

// log writes one container's log and returns the file's name in the
// bundle, or, when the API server cannot give it, says so in a note and
// returns what logs/containers.txt shows instead.
func (b *bundle) log(ctx context.Context, p *corev1.Pod, container string, previous bool) (string, error) {
	name := "logs/" + p.Name + "/" + container + ".log"
	if previous {
		name = "logs/" + p.Name + "/" + container + ".previous.log"
	}
	rc, err := b.o.kube.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: container, Previous: previous,
		LimitBytes: ptrTo(int64(maxLogBytes))}).Stream(ctx)
	if err != nil {
		b.note("log of %s/%s (previous: %v): %v", p.Name, container, previous, err)
		return "not collected: see NOTES.txt", nil
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxLogBytes))
	if err != nil {
		b.note("log of %s/%s (previous: %v), cut short: %v", p.Name, container, previous, err)
	}
	return name, b.write(name, data)
}

func ptrTo[T any](v T) *T { return &v }

// nodeState runs nodeCommands in each node's Cairn pods (kubectl exec);
// where exec is not allowed or the pod does not answer, a note says so.
func (b *bundle) nodeState(ctx context.Context) error {
	if b.o.kube == nil || b.o.rest == nil {
		b.note("node state: no connection to the API server for exec")
		return nil
	}
	var pods corev1.PodList
	if err := b.o.c.List(ctx, &pods, client.InNamespace(b.o.namespace)); err != nil {
		b.note("pods of %s: %v", b.o.namespace, err)
		return nil
	}
	for _, p := range pods.Items {
		for _, nc := range nodeCommands {
			if p.Labels["app.kubernetes.io/component"] != nc.component || p.Spec.NodeName == "" {
				continue
			}
			out, err := b.exec(ctx, &p, nc.container, nc.script)
			if err != nil {
				b.note("%s on node %s (exec in %s/%s): %v", nc.file, p.Spec.NodeName, p.Name, nc.container, err)
				continue
			}
			if err := b.write(path.Join("nodes", p.Spec.NodeName, nc.file), out); err != nil {
				return err
			}
		}
	}
	return nil
}

func (b *bundle) exec(ctx context.Context, p *corev1.Pod, container, script string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, execTimeout)
	defer cancel()
	req := b.o.kube.CoreV1().RESTClient().Post().Resource("pods").Namespace(p.Namespace).Name(p.Name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: []string{"sh", "-c", script}, Stdout: true, Stderr: true},
			clientgoscheme.ParameterCodec)
	ex, err := remotecommand.NewSPDYExecutor(b.o.rest, "POST", req.URL())
	if err != nil {
		return nil, err
	}
	var out execOutput
	err = ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &out, Stderr: &out})
	return out.bytes(), err
}

// execOutput is one writer for a command's stdout and stderr, in the
// order they arrive. remotecommand copies each stream in its own
// goroutine with io.Copy; a bytes.Buffer given as both would race, and
// io.Copy would use its ReadFrom, by which the stream that ends last cuts
// the buffer back to where it started reading: a command's whole stdout
// was lost that way whenever its empty stderr closed after it. Having
// only Write, under a lock, execOutput keeps every byte of both.
type execOutput struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (o *execOutput) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.Write(p)
}

func (o *execOutput) bytes() []byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	return bytes.Clone(o.buf.Bytes())
}
