// Package csi is Cairn's CSI driver: the Identity, Controller and Node
// services of the Container Storage Interface. The controller service turns
// CSI calls into Volume and Snapshot objects and waits for the reconcilers
// to act on them; the node service formats and mounts the block device the
// volume's engine reports on its node. Both talk to the Kubernetes API
// server only.
package csi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DriverName is the CSI driver's name: StorageClasses name it as their
// provisioner.
const DriverName = "storage.cairn.io"

// Mode picks the services a driver process serves.
type Mode string

// Modes.
const (
	// ModeController serves Identity and Controller: the Deployment beside
	// the external-provisioner, -attacher, -resizer and -snapshotter.
	ModeController Mode = "controller"
	// ModeNode serves Identity and Node: the DaemonSet on every node.
	ModeNode Mode = "node"
	// ModeAll serves all three (tests, single-node clusters).
	ModeAll Mode = "all"
)

// ParseMode checks a --mode flag value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeController, ModeNode, ModeAll:
		return m, nil
	}
	return "", fmt.Errorf("unknown mode %q: use controller, node or all", s)
}

// Options configure a Driver.
type Options struct {
	// Mode picks the services.
	Mode Mode
	// Version is reported by GetPluginInfo (the build's version).
	Version string
	// Client reaches the API server.
	Client client.Client
	// Namespace holds the driver's Volume and Snapshot objects.
	Namespace string
	// NodeID is the Kubernetes node this node service runs on.
	NodeID string
	// Mounter formats and mounts; nil takes the system's (mount, mkfs).
	Mounter Mounter
	// Logger gets one line per call (secrets stripped) and per failure.
	Logger logr.Logger
	// OverProvisioningPercent is cairn-manager's --over-provisioning-percent,
	// for GetCapacity to count a disk's room as the scheduler does; 0:
	// the scheduler's default.
	OverProvisioningPercent int
}

// Driver is a CSI plugin: the services Options.Mode picks, on one gRPC
// server.
type Driver struct {
	opts       Options
	identity   *IdentityServer
	controller *ControllerServer
	node       *NodeServer
}

// New checks opts and builds the services.
func New(opts Options) (*Driver, error) {
	if opts.Client == nil {
		return nil, errors.New("csi: Options.Client is required")
	}
	if opts.Namespace == "" {
		return nil, errors.New("csi: Options.Namespace is required")
	}
	if opts.Mode == "" {
		opts.Mode = ModeAll
	}
	if opts.Version == "" {
		opts.Version = "dev"
	}
	d := &Driver{opts: opts}
	if opts.Mode != ModeNode {
		d.controller = &ControllerServer{c: opts.Client, ns: opts.Namespace, locks: newKeyLocks(), overProvisioning: opts.OverProvisioningPercent}
	}
	if opts.Mode != ModeController {
		if opts.NodeID == "" {
			return nil, errors.New("csi: Options.NodeID is required for the node service (set --node-id or the NODE_NAME environment variable)")
		}
		m := opts.Mounter
		if m == nil {
			m = NewSystemMounter()
			if !hasCapSysResource() {
				opts.Logger.Info("this node plugin lacks CAP_SYS_RESOURCE: an ext4 volume expanded while mounted is not grown until it is staged again (NodeExpandVolume fails saying so); run the node plugin privileged to grow it online")
			}
		}
		d.node = &NodeServer{c: opts.Client, ns: opts.Namespace, nodeID: opts.NodeID, mounter: m, locks: newKeyLocks()}
	}
	d.identity = &IdentityServer{version: opts.Version, probe: d.probe}
	return d, nil
}

// probe reports whether the driver can do its work: the API server answers
// (controller) and this node's instance manager runs (node).
func (d *Driver) probe(ctx context.Context) error {
	if d.controller != nil {
		if err := d.controller.ready(ctx); err != nil {
			return err
		}
	}
	if d.node != nil {
		return d.node.ready(ctx)
	}
	return nil
}

// Register adds the driver's services to s.
func (d *Driver) Register(s *grpc.Server) {
	csipb.RegisterIdentityServer(s, d.identity)
	if d.controller != nil {
		csipb.RegisterControllerServer(s, d.controller)
	}
	if d.node != nil {
		csipb.RegisterNodeServer(s, d.node)
	}
}

// Probe runs the readiness check Probe reports, for a health endpoint.
func (d *Driver) Probe(ctx context.Context) error { return d.probe(ctx) }

// NewServer returns a gRPC server with the driver's services and the
// logging interceptor.
func (d *Driver) NewServer() *grpc.Server {
	s := grpc.NewServer(grpc.UnaryInterceptor(logCalls(d.opts.Logger)))
	d.Register(s)
	return s
}

// Listen opens a CSI endpoint: unix:///path, unix:/path or a bare path
// (a unix socket; a stale socket file is removed), or tcp://host:port.
func Listen(endpoint string) (net.Listener, error) {
	network, addr, err := parseEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	if network == "unix" {
		if err := os.MkdirAll(filepath.Dir(addr), 0o750); err != nil {
			return nil, err
		}
		if err := os.Remove(addr); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket %s: %w", addr, err)
		}
	}
	return net.Listen(network, addr)
}

func parseEndpoint(endpoint string) (network, addr string, err error) {
	if strings.HasPrefix(endpoint, "/") {
		return "unix", endpoint, nil
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		return "", "", fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	switch u.Scheme {
	case "unix":
		p := u.Path
		if p == "" {
			p = u.Opaque
		}
		if u.Host != "" {
			p = filepath.Join("/", u.Host, p)
		}
		if p == "" {
			break
		}
		return "unix", p, nil
	case "tcp":
		if u.Host != "" {
			return "tcp", u.Host, nil
		}
	}
	return "", "", fmt.Errorf("endpoint %q: use unix:///path/to/csi.sock or tcp://host:port", endpoint)
}
