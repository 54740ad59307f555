// Command kubectl-cairn is the kubectl plugin for Cairn (`kubectl cairn
// ...` once it is on the PATH): what a volume is made of, rebuilds in
// progress, snapshots, backups, and why a volume is not attached or not healthy.
// It reads the objects through the API server with the user's kubeconfig
// and changes nothing.
//
//	go install github.com/cairn-io/cairn/cmd/kubectl-cairn@latest
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/dataplane/volcrypt"
)

const usage = `kubectl cairn: look into Cairn volumes

usage: kubectl cairn [flags] COMMAND [ARGS]

commands:
  volumes              every volume with its engine and replicas (node, mode, health), as a tree
  rebuilds [--watch]   replicas being rebuilt, with progress bars (--watch: until none is left)
  snapshots [VOLUME]   snapshots, of one volume or all
  backups [VOLUME]     backups, of one volume or all: state, progress, bytes uploaded,
                       parent, and why one is not completed
  doctor VOLUME|NAMESPACE/CLAIM
                       why a volume is not attached or not healthy, and what to do;
                       a claim (PersistentVolumeClaim) stands for its volume
  salvage VOLUME [--give-up REPLICA,... --yes]
                       a faulted volume: which replicas its salvage waits for; with
                       --give-up and --yes, delete replicas whose disks are lost for
                       good so that it salvages from the others (their data is lost)
  drain-check NODE     what holds a drain of the node (kubectl drain waits for it): engines
                       running there, volumes whose every healthy replica is there;
                       exit code 3 while something does
  support-bundle [FILE]
                       write one archive (tar.gz; default cairn-support-TIME.tar.gz) for a bug
                       report: every Cairn object, the PersistentVolumes, claims, attachments and
                       StorageClasses of Cairn's driver, events, the logs of every pod of the
                       namespace (current and previous), each instance manager's processes,
                       each node's mounts, loop/nbd devices and disk usage, versions. Never a
                       Secret. Progress on stderr
  key-check            the key check (spec.encryption.keyCheck) of the passphrase on stdin,
                       for an encrypted Volume made by hand; reads no object

flags:
  -n, --namespace NS   where Cairn's objects are (default cairn-system)
  -o, --output FORMAT  table (default), json or yaml (volumes, rebuilds, snapshots, backups, drain-check)
  --kubeconfig FILE    as kubectl (default $KUBECONFIG or ~/.kube/config)
  --context NAME       a context of the kubeconfig
`

// stdin is where key-check reads the passphrase.
var stdin io.Reader = os.Stdin

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil))
}

// clients are what the commands talk to the API server with.
type clients struct {
	c    client.Client
	kube kubernetes.Interface
	rest *rest.Config
}

// run is the whole command; cl holds the clients to use (tests), or nil
// to build them from the kubeconfig.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, cl *clients) int {
	var o options
	var f runFlags
	fs := newFlagSet(&o, &f, stderr)
	rest, ok := parseAnywhere(fs, args)
	if !ok {
		return 2
	}
	if len(rest) == 0 {
		fs.Usage()
		return 2
	}
	switch o.output {
	case "table", "json", "yaml":
	default:
		fmt.Fprintf(stderr, "kubectl cairn: -o %s: use table, json or yaml\n", o.output)
		return 2
	}
	if rest[0] == "key-check" {
		return keyCheck(stdin, stdout, stderr)
	}
	if cl == nil {
		var err error
		if cl, err = newClients(f.kubeconfig, f.context); err != nil {
			fmt.Fprintln(stderr, "kubectl cairn:", err)
			return 1
		}
	}
	o.c, o.kube, o.rest, o.out = cl.c, cl.kube, cl.rest, stdout
	code, err := o.command(ctx, rest, f.giveUp, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "kubectl cairn:", err)
		return 1
	}
	return code
}

// runFlags are the flags that are not options of the commands: where
// the API server is, and salvage's --give-up.
type runFlags struct {
	kubeconfig, context, giveUp string
}

// newFlagSet defines every flag, into o and f; its usage goes to stderr.
func newFlagSet(o *options, f *runFlags, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("kubectl-cairn", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }
	fs.StringVar(&o.namespace, "namespace", "cairn-system", "")
	fs.StringVar(&o.namespace, "n", "cairn-system", "")
	fs.StringVar(&o.output, "output", "table", "")
	fs.StringVar(&o.output, "o", "table", "")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "")
	fs.StringVar(&f.context, "context", "", "")
	fs.BoolVar(&o.watch, "watch", false, "")
	fs.DurationVar(&o.interval, "interval", 2*time.Second, "")
	fs.StringVar(&f.giveUp, "give-up", "", "")
	fs.BoolVar(&o.yes, "yes", false, "")
	return fs
}

// parseAnywhere parses args with flags anywhere among the other arguments
// (kubectl cairn salvage VOL --give-up R), as with kubectl: parse, take the
// next argument, parse the rest. It returns the arguments that are not
// flags, and false if a flag is wrong (fs has said why).
func parseAnywhere(fs *flag.FlagSet, args []string) ([]string, bool) {
	var rest []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, false
		}
		if fs.NArg() == 0 {
			return rest, true
		}
		rest = append(rest, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// command runs the command rest[0] with its arguments rest[1:] and returns
// the exit code when it fails for no error: 2 for a wrong use (said on
// stderr), 3 when doctor finds the volume unhealthy or drain-check finds
// the drain held.
func (o *options) command(ctx context.Context, rest []string, giveUp string, stderr io.Writer) (int, error) {
	switch cmd := rest[0]; cmd {
	case "volumes":
		return 0, o.volumes(ctx)
	case "rebuilds":
		return 0, o.rebuilds(ctx)
	case "snapshots":
		vol := ""
		if len(rest) > 1 {
			vol = rest[1]
		}
		return 0, o.snapshots(ctx, vol)
	case "backups":
		vol := ""
		if len(rest) > 1 {
			vol = rest[1]
		}
		return 0, o.backups(ctx, vol)
	case "doctor":
		if len(rest) != 2 {
			fmt.Fprintln(stderr, "kubectl cairn: doctor needs one VOLUME (a Volume's name) or NAMESPACE/CLAIM (a PersistentVolumeClaim)")
			return 2, nil
		}
		return exit3Unless(o.doctor(ctx, rest[1]))
	case "drain-check":
		if len(rest) != 2 {
			fmt.Fprintln(stderr, "kubectl cairn: drain-check needs one NODE (a Kubernetes node's name)")
			return 2, nil
		}
		return exit3Unless(o.drainCheck(ctx, rest[1]))
	case "salvage":
		if len(rest) != 2 {
			fmt.Fprintln(stderr, "kubectl cairn: salvage needs one VOLUME")
			return 2, nil
		}
		var giveUps []string
		if giveUp != "" {
			giveUps = strings.Split(giveUp, ",")
		}
		return 0, o.salvage(ctx, rest[1], giveUps)
	case "support-bundle":
		if len(rest) > 2 {
			fmt.Fprintln(stderr, "kubectl cairn: support-bundle takes at most one FILE")
			return 2, nil
		}
		file := ""
		if len(rest) == 2 {
			file = rest[1]
		}
		return 0, o.supportBundle(ctx, file, stderr)
	default:
		fmt.Fprintf(stderr, "kubectl cairn: unknown command %q\n\n%s", cmd, usage)
		return 2, nil
	}
}

// exit3Unless turns a check's outcome into an exit code: 3 when the check
// ran and found ok false, 0 otherwise (err, if any, is the caller's to say).
func exit3Unless(ok bool, err error) (int, error) {
	if err == nil && !ok {
		return 3, nil
	}
	return 0, err
}

func newClients(kubeconfig, kubecontext string) (*clients, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if kubeconfig != "" {
		rules.ExplicitPath = kubeconfig
	}
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules,
		&clientcmd.ConfigOverrides{CurrentContext: kubecontext}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("no cluster to talk to (set KUBECONFIG or --kubeconfig): %w", err)
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &clients{c: c, kube: kube, rest: cfg}, nil
}

// keyCheck prints the key check of the passphrase on stdin (one trailing
// newline dropped, as `echo` adds one).
func keyCheck(in io.Reader, stdout, stderr io.Writer) int {
	b, err := io.ReadAll(io.LimitReader(in, volcrypt.MaxPassphrase+2))
	if err != nil {
		fmt.Fprintln(stderr, "kubectl cairn: key-check:", err)
		return 1
	}
	b = bytes.TrimSuffix(bytes.TrimSuffix(b, []byte("\n")), []byte("\r"))
	key, err := volcrypt.DeriveKey(b)
	if err != nil {
		fmt.Fprintf(stderr, "kubectl cairn: key-check: %v (got %d bytes on stdin)\n", err, len(b))
		return 2
	}
	fmt.Fprintln(stdout, volcrypt.KeyCheck(key))
	return 0
}
