// Package v1alpha1 holds the Cairn storage API: Volume, Engine, Replica,
// InstanceManager and StorageNode, in the group storage.cairn.io.
//
// A Volume is what a user (through the CSI driver) asks for. The Volume
// reconciler turns it into one Engine and N Replica objects; the Engine and
// Replica reconcilers start data-plane processes through the InstanceManager
// of a node; StorageNode describes the disks replicas are scheduled onto.
//
// +kubebuilder:object:generate=true
// +groupName=storage.cairn.io
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the group and version of every kind in this package.
	GroupVersion = schema.GroupVersion{Group: "storage.cairn.io", Version: "v1alpha1"}

	// SchemeBuilder registers the kinds of this package with a runtime.Scheme.
	// controller-runtime's Builder is deprecated for api packages (they
	// should not import controller-runtime); every *_types.go registers its
	// kinds through it in init, the layout kubebuilder generates.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion} //nolint:staticcheck // SA1019: see above

	// AddToScheme adds the kinds of this package to a runtime.Scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
