package csi

import (
	"context"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// IdentityServer is the CSI Identity service.
type IdentityServer struct {
	csipb.UnimplementedIdentityServer
	version string
	probe   func(context.Context) error
}

// GetPluginInfo reports the driver's name and build version.
func (s *IdentityServer) GetPluginInfo(context.Context, *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	return &csipb.GetPluginInfoResponse{Name: DriverName, VendorVersion: s.version}, nil
}

// GetPluginCapabilities describes the plugin as deployed, whichever of its
// services this process serves (the CSI spec's "plugin as a whole"): the
// node plugin answers as the controller plugin does, so that a client
// talking to the node's socket alone (kubelet, csi-sanity against a split
// deployment) knows volumes must be controller-published before they are
// staged. Online expansion; no topology, since an engine can run on any
// node and reach replicas on every other.
func (s *IdentityServer) GetPluginCapabilities(context.Context, *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	return &csipb.GetPluginCapabilitiesResponse{Capabilities: []*csipb.PluginCapability{
		{Type: &csipb.PluginCapability_Service_{Service: &csipb.PluginCapability_Service{Type: csipb.PluginCapability_Service_CONTROLLER_SERVICE}}},
		{Type: &csipb.PluginCapability_VolumeExpansion_{VolumeExpansion: &csipb.PluginCapability_VolumeExpansion{Type: csipb.PluginCapability_VolumeExpansion_ONLINE}}},
	}}, nil
}

// Probe reports ready once the controller service reaches the API server
// and the node service finds its node's instance manager running. Not
// ready is an answer, not an error: the reason goes to the log.
func (s *IdentityServer) Probe(ctx context.Context, _ *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	if err := s.probe(ctx); err != nil {
		logFrom(ctx).Info("probe: not ready", "reason", err.Error())
		return &csipb.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
	}
	return &csipb.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
