package csi

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"

	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// DefaultRegistryDir is where kubelet's plugin watcher looks for
// registration sockets.
const DefaultRegistryDir = "/var/lib/kubelet/plugins_registry"

// Registration answers kubelet's plugin watcher: what the
// node-driver-registrar sidecar does, served by the node plugin itself
// (that image cannot be built where Cairn is developed, and one process
// fewer per node is no loss). kubelet finds <registry>/<driver>-reg.sock,
// calls GetInfo, dials the CSI endpoint it names, and reports back through
// NotifyRegistrationStatus.
type Registration struct {
	registerapi.UnimplementedRegistrationServer
	// Endpoint is the CSI socket's path as kubelet sees it (on the host),
	// such as /var/lib/kubelet/plugins/storage.cairn.io/csi.sock.
	Endpoint string
	Logger   logr.Logger

	mu         sync.Mutex
	registered bool
	lastErr    string
}

// SocketPath is the registration socket for a registry directory.
func SocketPath(registryDir string) string {
	return filepath.Join(registryDir, DriverName+"-reg.sock")
}

// GetInfo tells kubelet the plugin's kind, name, CSI endpoint and the
// CSI versions it speaks.
func (r *Registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{Type: registerapi.CSIPlugin, Name: DriverName, Endpoint: r.Endpoint,
		SupportedVersions: []string{"1.0.0"}}, nil
}

// NotifyRegistrationStatus records kubelet's verdict; a refusal is logged
// with kubelet's reason (and fails Registered, so the liveness probe
// restarts the plugin, which registers again).
func (r *Registration) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	r.mu.Lock()
	r.registered, r.lastErr = st.GetPluginRegistered(), st.GetError()
	r.mu.Unlock()
	if st.GetPluginRegistered() {
		r.Logger.Info("registered with kubelet", "endpoint", r.Endpoint)
	} else {
		r.Logger.Info("kubelet refused the registration", "error", st.GetError())
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// Registered reports an error when kubelet refused the registration.
func (r *Registration) Registered() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.registered && r.lastErr != "" {
		return fmt.Errorf("kubelet refused the plugin registration: %s", r.lastErr)
	}
	return nil
}

// Serve serves the registration socket in registryDir until ctx ends.
func (r *Registration) Serve(ctx context.Context, registryDir string) error {
	l, err := Listen(SocketPath(registryDir))
	if err != nil {
		return fmt.Errorf("registration socket in %s: %w", registryDir, err)
	}
	s := grpc.NewServer()
	registerapi.RegisterRegistrationServer(s, r)
	go func() {
		<-ctx.Done()
		s.Stop()
	}()
	return s.Serve(l)
}
