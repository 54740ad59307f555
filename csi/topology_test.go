package csi

import (
	"reflect"
	"testing"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// TestNodeGetInfoTopology: the node plugin reports one topology segment,
// TopologyKeyNodePlugin with the same value whatever the node, which
// kubelet can record as a node label (a valid label key and value); the
// plugin still does not advertise VOLUME_ACCESSIBILITY_CONSTRAINTS, so
// provisioning and PersistentVolumes stay free of topology.
func TestNodeGetInfoTopology(t *testing.T) {
	g := NewWithT(t)
	ctx := callCtx(t)
	g.Expect(validation.IsQualifiedName(TopologyKeyNodePlugin)).To(BeEmpty(), "a label key")
	g.Expect(validation.IsValidLabelValue(NodePluginTopologyValue)).To(BeEmpty(), "a label value")
	want := map[string]string{TopologyKeyNodePlugin: NodePluginTopologyValue}
	for _, node := range []string{"topo-a", "topo-b"} {
		d := serveDriver(t, Options{Mode: ModeNode, NodeID: node})
		info, err := d.node.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(info.GetNodeId()).To(Equal(node))
		g.Expect(info.GetAccessibleTopology().GetSegments()).To(Equal(want), "node %s", node)

		caps, err := d.identity.GetPluginCapabilities(ctx, &csipb.GetPluginCapabilitiesRequest{})
		g.Expect(err).NotTo(HaveOccurred())
		for _, c := range caps.GetCapabilities() {
			g.Expect(c.GetService().GetType()).NotTo(Equal(csipb.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
				"the segment is for capacity objects only, never a constraint on volumes")
		}
	}
}

// TestCapacitySelectorRoundTrip: a CSIStorageCapacity whose node topology
// selects the node plugin's segment comes back from the API server with
// the selector it was created with, compared as the external-provisioner
// compares them (reflect.DeepEqual). An empty segment does not: the API
// server drops the empty matchLabels, which is why the node plugin reports
// a segment at all.
func TestCapacitySelectorRoundTrip(t *testing.T) {
	g := NewWithT(t)
	ctx := callCtx(t)
	for _, tc := range []struct {
		name     string
		labels   map[string]string
		survives bool
	}{
		{"node-plugin-segment", map[string]string{TopologyKeyNodePlugin: NodePluginTopologyValue}, true},
		{"empty-segment", map[string]string{}, false},
	} {
		sel := &metav1.LabelSelector{MatchLabels: tc.labels}
		c := &storagev1.CSIStorageCapacity{
			ObjectMeta:       metav1.ObjectMeta{Namespace: testNamespace, Name: "roundtrip-" + tc.name},
			StorageClassName: "roundtrip",
			NodeTopology:     sel.DeepCopy(),
			Capacity:         resource.NewQuantity(1<<30, resource.BinarySI),
		}
		g.Expect(cluster.Client.Create(ctx, c)).To(Succeed())
		t.Cleanup(func() { _ = cluster.Client.Delete(ctx, c) })
		var got storagev1.CSIStorageCapacity
		g.Expect(cluster.Client.Get(ctx, client.ObjectKeyFromObject(c), &got)).To(Succeed())
		g.Expect(reflect.DeepEqual(sel, got.NodeTopology)).To(Equal(tc.survives), "%s: created %v, stored %v", tc.name, sel, got.NodeTopology)
	}
}
