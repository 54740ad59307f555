// Command cairn-csi is Cairn's CSI driver: the controller service (beside
// the CSI sidecars, --mode=controller) or the node service (a privileged
// DaemonSet, --mode=node), talking to the Kubernetes API server only.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	v1 "github.com/cairn-io/cairn/api/v1alpha1"
	"github.com/cairn-io/cairn/csi"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

type flags struct {
	mode, endpoint, nodeID, namespace, healthAddr string
	register                                      bool
	registryDir, kubeletEndpoint                  string
	overProvisioning                              int
}

func main() {
	var f flags
	flag.StringVar(&f.mode, "mode", "all", "Services to serve: controller, node or all.")
	flag.StringVar(&f.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint: unix:///path or tcp://host:port.")
	flag.StringVar(&f.nodeID, "node-id", os.Getenv("NODE_NAME"), "Kubernetes node this node service runs on (default $NODE_NAME).")
	flag.StringVar(&f.namespace, "namespace", envOr("POD_NAMESPACE", "cairn-system"), "Namespace of Cairn's Volume and Snapshot objects (default $POD_NAMESPACE, else cairn-system).")
	flag.StringVar(&f.healthAddr, "health-address", ":9808", "Address of the liveness (/healthz) and readiness (/readyz) endpoints; empty disables them.")
	flag.BoolVar(&f.register, "register", true, "Node mode: serve kubelet's plugin registration socket in --registry-dir. Turn off where the node-driver-registrar sidecar runs.")
	flag.StringVar(&f.registryDir, "registry-dir", csi.DefaultRegistryDir, "kubelet's plugin registry directory.")
	flag.StringVar(&f.kubeletEndpoint, "kubelet-endpoint", "/var/lib/kubelet/plugins/"+csi.DriverName+"/csi.sock",
		"The CSI socket's path on the host, as kubelet dials it.")
	flag.IntVar(&f.overProvisioning, "over-provisioning-percent", 100,
		"Controller mode: cairn-manager's --over-provisioning-percent, for GetCapacity to count each disk's room as the replica scheduler does; give both the same value.")
	zapOpts := zap.Options{}
	zapOpts.BindFlags(flag.CommandLine)
	flag.Parse()
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&zapOpts)))
	if err := run(f); err != nil {
		fmt.Fprintln(os.Stderr, "cairn-csi:", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(f flags) error {
	mode, err := csi.ParseMode(f.mode)
	if err != nil {
		return fmt.Errorf("--mode: %w", err)
	}
	if f.overProvisioning <= 0 {
		return fmt.Errorf("--over-provisioning-percent must be positive, not %d", f.overProvisioning)
	}
	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(v1.AddToScheme(scheme))
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return fmt.Errorf("no Kubernetes configuration (set KUBECONFIG or run in a pod): %w", err)
	}
	c, err := client.NewWithWatch(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return err
	}
	log := ctrl.Log.WithName("csi")
	d, err := csi.New(csi.Options{Mode: mode, Version: version, Client: c, Namespace: f.namespace, NodeID: f.nodeID, Logger: log,
		OverProvisioningPercent: f.overProvisioning})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	l, err := csi.Listen(f.endpoint)
	if err != nil {
		return fmt.Errorf("--endpoint %s: %w", f.endpoint, err)
	}
	srv := d.NewServer()
	errc := make(chan error, 4)
	go func() { errc <- srv.Serve(l) }()

	if mode != csi.ModeController {
		// Filesystem-trim RecurringJobs ask the node a volume is attached
		// to to trim it (docs/backup.md, Recurring jobs).
		go func() { errc <- d.ServeTrims(ctx, c) }()
	}

	var reg *csi.Registration
	if f.register && mode != csi.ModeController {
		reg = &csi.Registration{Endpoint: f.kubeletEndpoint, Logger: log.WithName("registration")}
		go func() { errc <- reg.Serve(ctx, f.registryDir) }()
	}
	if f.healthAddr != "" {
		hs := serveHealth(f.healthAddr, reg, d, errc)
		defer hs.Close()
	}
	log.Info("serving", "mode", mode, "endpoint", f.endpoint, "version", version, "node", f.nodeID)
	select {
	case <-ctx.Done():
		srv.GracefulStop()
		return nil
	case err := <-errc:
		return err
	}
}

// serveHealth serves /healthz and /readyz on addr; a failure to listen
// goes to errc.
func serveHealth(addr string, reg *csi.Registration, d *csi.Driver, errc chan<- error) *http.Server {
	mux := http.NewServeMux()
	// /healthz (liveness): the process serves and kubelet has not
	// refused its registration. /readyz adds Probe's checks (the API
	// server; this node's instance manager), which a restart would not
	// fix.
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if reg != nil {
			if err := reg.Registered(); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		pctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
		defer cancel()
		if err := d.Probe(pctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	hs := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := hs.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("--health-address %s: %w", addr, err)
		}
	}()
	return hs
}
