// Package controllers is the home of Cairn's reconcilers, one package per
// kind (controllers/volume, controllers/engine, ...). This file holds the
// RBAC markers for the permissions the manager's ServiceAccount needs;
// controller-gen turns them into config/rbac/role.yaml.
//
// The envtest suite in this directory checks the CRD schemas against a real
// API server.
package controllers

// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes;engines;replicas;instancemanagers;storagenodes,verbs=get;list;watch;create;update;patch;delete
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/status;engines/status;replicas/status;instancemanagers/status;storagenodes/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.cairn.io,resources=volumes/finalizers;engines/finalizers;replicas/finalizers;instancemanagers/finalizers;storagenodes/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
