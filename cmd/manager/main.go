// Command cairn-manager runs Cairn's reconcilers against a Kubernetes API
// server. It is deployed as the leader-elected cairn-manager Deployment.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	storagev1alpha1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/controllers/backup"
	"github.com/cairn-io/cairn/controllers/backuptarget"
	"github.com/cairn-io/cairn/controllers/certs"
	"github.com/cairn-io/cairn/controllers/claims"
	"github.com/cairn-io/cairn/controllers/drain"
	"github.com/cairn-io/cairn/controllers/engine"
	"github.com/cairn-io/cairn/controllers/imclient"
	"github.com/cairn-io/cairn/controllers/instancemanager"
	cairnmetrics "github.com/cairn-io/cairn/controllers/metrics"
	"github.com/cairn-io/cairn/controllers/recurringjob"
	"github.com/cairn-io/cairn/controllers/replica"
	"github.com/cairn-io/cairn/controllers/scheduler"
	"github.com/cairn-io/cairn/controllers/secretguard"
	"github.com/cairn-io/cairn/controllers/snapshot"
	"github.com/cairn-io/cairn/controllers/storagenode"
	"github.com/cairn-io/cairn/controllers/ui"
	"github.com/cairn-io/cairn/controllers/volume"
	"github.com/cairn-io/cairn/controllers/workload"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == drain.GuardArg {
		guard()
		return
	}
	var (
		metricsAddr    string
		metricsSecure  bool
		probeAddr      string
		uiAddr         string
		leaderElection bool
		vr             volume.Reconciler
		disc           discovery
		pki            pkiFlags
		wl             workload.Reconciler
		dr             drain.Reconciler
	)
	flag.StringVar(&metricsAddr, "metrics-bind-address", ":8443", "Address the metrics endpoint binds to; \"0\" disables it.")
	flag.BoolVar(&metricsSecure, "metrics-secure", true, "Serve metrics over HTTPS and only to callers whose bearer token the API server "+
		"authenticates and allows to get /metrics (the ClusterRole cairn-metrics-reader); false: plain HTTP to anyone who reaches the port. "+
		"The certificate is one of Cairn's CA for the Service cairn-manager-metrics (its CA bundle in the ConfigMap "+certs.DefaultBundleConfigMap+"), self-signed with --instance-manager-tls=false.")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "Address the health and readiness probes bind to.")
	flag.StringVar(&uiAddr, "ui-bind-address", "127.0.0.1:8082", "Address of the read-only web page; on the pod's loopback (the default) only kubectl port-forward reaches it, through the API server's authentication; \"0\" disables it.")
	flag.BoolVar(&leaderElection, "leader-elect", false, "Elect a leader so that only one manager reconciles at a time.")
	flag.DurationVar(&vr.ReplenishmentWait, "replenishment-wait", volume.DefaultReplenishmentWait,
		"How long a failed replica may take to come back (and resync only what it missed) before a replacement is built on another node.")
	flag.IntVar(&vr.ConcurrentRebuildLimit, "concurrent-rebuild-limit", volume.DefaultConcurrentRebuildLimit,
		"How many replicas of one volume are rebuilt at a time.")
	flag.IntVar(&vr.OverProvisioningPercent, "over-provisioning-percent", 100,
		"Replicas may be scheduled on a disk up to this percentage of its capacity (less storageReserved).")
	flag.StringVar(&disc.namespace, "namespace", envOr("POD_NAMESPACE", "cairn-system"),
		"Namespace of the instance-manager pods and of the InstanceManager and StorageNode objects discovered from them.")
	flag.BoolVar(&disc.enabled, "discover-instance-managers", true,
		"Keep an InstanceManager (and a StorageNode) per node where an instance-manager pod is ready; off where instance managers are registered by hand.")
	flag.StringVar(&disc.selector, "instance-manager-selector", instancemanager.DefaultPodSelector, "Label selector of the instance-manager DaemonSet's pods.")
	flag.BoolVar(&pki.enabled, "instance-manager-tls", true,
		"Talk to instance managers over mutual TLS with certificates this manager issues (CA in --ca-secret, the instance managers' in --instance-manager-tls-secret); "+
			"off only for instance managers started with --insecure.")
	flag.StringVar(&pki.caSecret, "ca-secret", certs.DefaultCASecret, "Secret (in --namespace) holding Cairn's CA; made on first start. Annotate it "+certs.AnnotationRotate+"=<new value> to rotate the CA.")
	flag.StringVar(&pki.servingSecret, "instance-manager-tls-secret", certs.DefaultServingSecret, "Secret (in --namespace) the manager keeps the instance managers' serving certificate and trust bundle in.")
	flag.DurationVar(&pki.validity, "certificate-validity", certs.DefaultValidity, "Lifetime of the issued certificates; each is renewed when a third of it is left.")
	flag.BoolVar(&wl.DeletePods, workload.FlagDeletePods, true,
		"When a volume's device is lost under its pods while it stays attached (an engine restart whose frontend could not keep the device), delete the pods on that node "+
			"that use it and that a controller owns, so they come back with a fresh mount (an Event on the pod and the claim says why either way); false: the Events only.")
	flag.BoolVar(&pki.dataTLS, "data-tls", false,
		"The instance managers run with --data-tls (replicas serve their data ports with TLS): the manager's restores from backups, which write into a new volume's replicas, and its backups, which read a replica's data port, connect with TLS too.")
	flag.StringVar(&dr.GuardImage, "drain-guard-image", "",
		"Image of the per-node drain guard pods (it must run this binary with the argument drain-guard); empty: the manager's own image, read from its pod ($POD_NAME).")
	zapOpts := zap.Options{}
	zapOpts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&zapOpts)))

	if err := checkFlags(&vr, pki); err != nil {
		fmt.Fprintln(os.Stderr, "cairn-manager:", err)
		os.Exit(2)
	}
	metricsOpts := metricsserver.Options{BindAddress: metricsAddr}
	if metricsSecure {
		metricsOpts.SecureServing = true
		metricsOpts.FilterProvider = cairnmetrics.Authenticated
		// HTTP/1.1 only: HTTP/2's stream resets let one client keep the
		// server busy (CVE-2023-44487), and a scrape needs nothing more.
		metricsOpts.TLSOpts = []func(*tls.Config){func(c *tls.Config) { c.NextProtos = []string{"http/1.1"} }}
	}
	dr.ManagerPod, dr.ManagerContainer = client.ObjectKey{Namespace: disc.namespace, Name: os.Getenv("POD_NAME")}, "manager"
	dr.OverProvisioningPercent = vr.OverProvisioningPercent
	// One Ledger places every replica the manager places, so the Volume
	// reconciler and the drain controller never count the same room.
	vr.Ledger = scheduler.NewLedger()
	dr.Ledger = vr.Ledger
	if err := run(metricsOpts, probeAddr, uiAddr, leaderElection, &vr, disc, pki, &wl, &dr); err != nil {
		fmt.Fprintln(os.Stderr, "cairn-manager:", err)
		os.Exit(1)
	}
}

// guard is the drain guard pod's whole work (controllers/drain): to be
// there until it is evicted or deleted.
func guard() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, os.Interrupt)
	<-c
}

// discovery is how the manager finds instance managers in a cluster.
type discovery struct {
	enabled   bool
	namespace string
	selector  string
}

// pkiFlags say whether and how the manager authenticates to instance
// managers.
type pkiFlags struct {
	enabled                 bool
	caSecret, servingSecret string
	validity                time.Duration
	// dataTLS: the instance managers serve replicas' data ports with TLS.
	dataTLS bool
}

// checkFlags refuses flag values the manager cannot run with.
func checkFlags(vr *volume.Reconciler, pki pkiFlags) error {
	if vr.ReplenishmentWait <= 0 || vr.ConcurrentRebuildLimit <= 0 || vr.OverProvisioningPercent <= 0 {
		return errors.New("--replenishment-wait, --concurrent-rebuild-limit and --over-provisioning-percent must be positive")
	}
	if pki.validity < 3*time.Hour {
		return errors.New("--certificate-validity must be at least 3h (certificates are renewed with a third of it left; kubelet takes up to a few minutes to hand renewed files to the instance managers)")
	}
	if pki.dataTLS && !pki.enabled {
		return errors.New("--data-tls needs --instance-manager-tls: the client certificate the manager shows the replicas' data ports (backups and restores) is issued by Cairn's CA")
	}
	return nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(metricsOpts metricsserver.Options, probeAddr, uiAddr string, leaderElection bool, vr *volume.Reconciler, disc discovery, pki pkiFlags, wl *workload.Reconciler, dr *drain.Reconciler) error {
	sel, err := labels.Parse(disc.selector)
	if err != nil {
		return fmt.Errorf("--instance-manager-selector %q: %w", disc.selector, err)
	}
	// The metrics port serves the certificate Cairn's CA issues for it
	// (controllers/certs). The CA is made after the manager (it uses the
	// manager's clients) but before the manager starts serving, so every
	// handshake finds it set.
	var ca *certs.Authority
	if pki.enabled && metricsOpts.SecureServing {
		metricsOpts.TLSOpts = append(metricsOpts.TLSOpts, func(c *tls.Config) {
			c.GetCertificate = func(h *tls.ClientHelloInfo) (*tls.Certificate, error) { return ca.MetricsCertificate(h) }
		})
	}
	mgr, err := newManager(metricsOpts, probeAddr, leaderElection, disc.namespace, sel)
	if err != nil {
		return err
	}
	// One connection per instance manager, shared by every reconciler;
	// mutual TLS with certificates from Cairn's own CA.
	poolOpts := imclient.Options{Logger: ctrl.Log.WithName("imclient")}
	ca, engineDial, err := setupPKI(mgr, disc.namespace, pki, &poolOpts)
	if err != nil {
		return err
	}
	var keys certs.VolumeKeys
	if ca != nil {
		keys = ca
		// A restore writes into a volume's replicas from the manager,
		// as an engine would (controllers/volume/restore.go).
		vr.Restore.Keys, vr.Restore.ControlTLS = ca, ca.ClientTLS()
		if pki.dataTLS {
			vr.Restore.DataTLS = ca.ClientTLS()
		}
	}
	imr := instancemanager.NewReconciler(mgr.GetClient(), nil)
	poolOpts.OnChange = imr.Changed
	pool := imclient.New(poolOpts)
	defer pool.Close()
	imr.Pool = pool
	if err := imr.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the InstanceManager reconciler: %w", err)
	}
	c := mgr.GetClient()
	if disc.enabled {
		if err := setupDiscovery(mgr, disc.namespace, sel); err != nil {
			return err
		}
	}
	er := &engine.Reconciler{Client: c, Pool: pool, Keys: keys, DialOptions: engineDial}
	wl.Client, wl.Namespace, dr.Client = c, disc.namespace, c
	for kind, setup := range map[string]func(ctrl.Manager) error{
		"StorageNode": (&storagenode.Reconciler{Client: c, Pool: pool, OverProvisioningPercent: vr.OverProvisioningPercent}).SetupWithManager,
		"Replica":     (&replica.Reconciler{Client: c, Pool: pool, Keys: keys}).SetupWithManager,
		"Engine":      er.SetupWithManager,
		"Volume":      func(mgr ctrl.Manager) error { vr.Client = c; return vr.SetupWithManager(mgr) },
		"Snapshot":    (&snapshot.Reconciler{Client: c, Pool: pool, DialOptions: engineDial}).SetupWithManager,
		"workload":    wl.SetupWithManager,
		"drain":       dr.SetupWithManager,
		// A volume's trouble as Events on its claim and pods.
		"volume-events": (&claims.Forwarder{Client: c, Namespace: disc.namespace}).SetupWithManager,
		// The Secrets Cairn's PersistentVolumes name kept while they do.
		"secret-guard": (&secretguard.Reconciler{}).SetupWithManager,
		// Whether each BackupTarget is reachable and writable.
		"BackupTarget": (&backuptarget.Reconciler{}).SetupWithManager,
		// Backups, uploaded from a replica's snapshot by this process.
		"Backup": (&backup.Reconciler{DialOptions: engineDial, Keys: keys, DataTLS: vr.Restore.DataTLS}).SetupWithManager,
		// Snapshots and Backups on a schedule, pruned to their retention.
		"RecurringJob": (&recurringjob.Reconciler{Client: c}).SetupWithManager,
	} {
		if err := setup(mgr); err != nil {
			return fmt.Errorf("set up the %s reconciler: %w", kind, err)
		}
	}
	if err := setupObservability(mgr, er, uiAddr, disc.namespace); err != nil {
		return err
	}
	ctrl.Log.WithName("setup").Info("starting cairn-manager")
	return mgr.Start(ctrl.SetupSignalHandler())
}

// newManager makes the controller-runtime manager with its health and
// readiness checks; of the pods, only the instance managers' (namespace
// and selector sel) are cached, not every pod of the cluster.
func newManager(metricsOpts metricsserver.Options, probeAddr string, leaderElection bool, namespace string, sel labels.Selector) (ctrl.Manager, error) {
	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(storagev1alpha1.AddToScheme(scheme))

	cfg, err := ctrl.GetConfig()
	if err != nil {
		return nil, fmt.Errorf("no Kubernetes configuration (set KUBECONFIG or run in a pod): %w", err)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsOpts,
		HealthProbeBindAddress: probeAddr,
		LeaderElection:         leaderElection,
		LeaderElectionID:       "cairn-manager.storage.cairn.io",
		Cache: cache.Options{ByObject: map[client.Object]cache.ByObject{
			&corev1.Pod{}: {Namespaces: map[string]cache.Config{namespace: {}}, Label: sel},
		}},
	})
	if err != nil {
		return nil, fmt.Errorf("create manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, fmt.Errorf("add health check: %w", err)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return nil, fmt.Errorf("add ready check: %w", err)
	}
	return mgr, nil
}

// setupPKI adds Cairn's certificate authority to mgr when pki is enabled:
// poolOpts then dials instance managers with mutual TLS, and it returns
// the authority (the volumes' data-connection keys, the metrics
// certificate) and the dial options for engines' control APIs. Disabled:
// nil, nil.
func setupPKI(mgr ctrl.Manager, namespace string, pki pkiFlags, poolOpts *imclient.Options) (*certs.Authority, []grpc.DialOption, error) {
	if !pki.enabled {
		return nil, nil, nil
	}
	ca := certs.New(certs.Options{Namespace: namespace, CASecret: pki.caSecret, ServingSecret: pki.servingSecret,
		Validity: pki.validity, Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Logger: ctrl.Log.WithName("certs")})
	if err := mgr.Add(ca); err != nil {
		return nil, nil, fmt.Errorf("add the certificate authority: %w", err)
	}
	if err := mgr.AddReadyzCheck("certificates", ca.Ready); err != nil {
		return nil, nil, fmt.Errorf("add ready check: %w", err)
	}
	poolOpts.DialOptions = []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(ca.ClientTLS()))}
	// Each volume's engine and replicas authenticate their data
	// connections with a key derived from the CA Secret's master; engines
	// serve their control API with their instance manager's certificate.
	return ca, poolOpts.DialOptions, nil
}

// setupDiscovery adds the instance-manager pods' discovery (an
// InstanceManager per node with a ready pod) and their readiness gate: a
// rolling update of the DaemonSet goes to the next node once this one
// serves its volumes again.
func setupDiscovery(mgr ctrl.Manager, namespace string, sel labels.Selector) error {
	c := mgr.GetClient()
	d := &instancemanager.PodDiscovery{Client: c, Namespace: namespace, Selector: sel}
	if err := d.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up instance-manager discovery: %w", err)
	}
	if err := (&instancemanager.PodGate{Client: c, Namespace: namespace, Selector: sel}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the instance-manager readiness gate: %w", err)
	}
	return nil
}

// setupObservability registers the Prometheus collector (volumes,
// replicas, disks, instance managers and each running engine's I/O, read
// at scrape time and served with controller-runtime's own metrics on
// --metrics-bind-address) and, unless uiAddr is "0", the read-only web
// page (volumes, replicas by node, rebuilds, disks, events, and I/O
// sparklines from its own samples of the engines).
func setupObservability(mgr ctrl.Manager, er *engine.Reconciler, uiAddr, namespace string) error {
	c := mgr.GetClient()
	runningEngines := func() cairnmetrics.Engines {
		if er.Engines == nil {
			return nil
		}
		return er.Engines
	}
	ctrlmetrics.Registry.MustRegister(&cairnmetrics.Collector{Client: c, Logger: ctrl.Log.WithName("metrics"), Engines: runningEngines})
	if uiAddr == "0" {
		return nil
	}
	page := &ui.Server{Client: c, Events: mgr.GetAPIReader(), Namespace: namespace, Engines: runningEngines,
		Logger: ctrl.Log.WithName("ui")}
	if err := mgr.Add(page); err != nil {
		return fmt.Errorf("add the web page's sampler: %w", err)
	}
	if err := mgr.Add(&httpServer{addr: uiAddr, handler: page}); err != nil {
		return fmt.Errorf("add the web page: %w", err)
	}
	return nil
}

// httpServer serves handler on addr while the manager runs (in every
// replica, leader or not).
type httpServer struct {
	addr    string
	handler http.Handler
}

func (h *httpServer) NeedLeaderElection() bool { return false }

func (h *httpServer) Start(ctx context.Context) error {
	srv := &http.Server{Addr: h.addr, Handler: h.handler, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	case err := <-errc:
		return fmt.Errorf("web page on %s: %w", h.addr, err)
	}
}
