#!/usr/bin/env bash
# deploy.sh: apply Cairn (config/default, config/storage) to the cluster in
# KUBECONFIG, one component at a time, each rolled out before the next:
#
#   1. the namespace, the CRDs (until established), RBAC, service accounts;
#   2. the manager: the new manager decides the instance-manager pods'
#      readiness gate, and talks to the data plane of the previous
#      version until step 6 is done (docs/install.md#upgrade);
#   3. the CSI controller;
#   4. the CSIDriver and StorageClasses (config/storage);
#   5. the CSI node plugin DaemonSet, which runs the device keeper, once
#      an instance-manager rollout in progress (a previous deploy's) has
#      ended;
#   6. the instance-manager DaemonSet, node by node (its readiness gate
#      holds each next node until the last one serves its volumes again);
#   7. the VolumeSnapshotClass, where the cluster has the snapshot CRDs.
#
# Steps 5 and 6 never overlap: a device keeper and the instance manager of
# one node must not restart together, or the FUSE devices of the engines
# down at that moment are lost (docs/reliability.md). A fresh install goes
# the same way. `make deploy` sets the images in config/*/kustomization.yaml
# and runs this; KUSTOMIZE and KUBECTL name the tools, ROLLOUT_TIMEOUT
# bounds each wait (default 30m: the instance managers roll one node at a
# time, each after its replicas' resync).
set -euo pipefail
cd "$(dirname "$0")/.."
KUSTOMIZE=${KUSTOMIZE:-kustomize}
KUBECTL=${KUBECTL:-kubectl}
ROLLOUT_TIMEOUT=${ROLLOUT_TIMEOUT:-30m}
NS=cairn-system
COMPONENT=app.kubernetes.io/component
say() { printf 'deploy: %s (%s)\n' "$*" "$(date -u +%T)"; }

manifests=$(mktemp)
trap 'rm -f "$manifests"' EXIT
$KUSTOMIZE build config/default >"$manifests"

# apply SELECTOR: the objects of the build whose labels match.
apply() { $KUBECTL apply --server-side --force-conflicts -l "$1" -f "$manifests"; }
rollout() {
  say "waiting for $1 to roll out (at most $ROLLOUT_TIMEOUT)"
  if ! $KUBECTL -n "$NS" rollout status "$1" --timeout="$ROLLOUT_TIMEOUT"; then
    echo "deploy: $1 did not roll out within $ROLLOUT_TIMEOUT; nothing after it was applied." >&2
    echo "deploy: see kubectl -n $NS describe $1, and its pods' events and logs; run make deploy again once it is fixed." >&2
    exit 1
  fi
}

say "1/7 namespace, CRDs, RBAC"
apply "$COMPONENT notin (manager,csi-controller,csi-node,instance-manager)"
$KUBECTL wait --for=condition=Established --timeout=2m crd -l app.kubernetes.io/part-of=cairn

say "2/7 manager"
apply "$COMPONENT=manager"
rollout deployment/cairn-manager

say "3/7 CSI controller"
apply "$COMPONENT=csi-controller"
rollout deployment/cairn-csi-controller

say "4/7 CSIDriver and StorageClasses"
$KUSTOMIZE build config/storage | $KUBECTL apply --server-side -f -

say "5/7 CSI node plugin and device keeper"
if $KUBECTL -n "$NS" get daemonset cairn-instance-manager >/dev/null 2>&1; then
  # A keeper must not restart on a node whose instance manager does.
  rollout daemonset/cairn-instance-manager
fi
apply "$COMPONENT=csi-node"
rollout daemonset/cairn-csi-node

say "6/7 instance managers, one node at a time"
apply "$COMPONENT=instance-manager"
rollout daemonset/cairn-instance-manager

say "7/7 VolumeSnapshotClass"
if $KUBECTL get crd volumesnapshotclasses.snapshot.storage.k8s.io >/dev/null 2>&1; then
  $KUBECTL apply --server-side -f config/storage/volumesnapshotclass.yaml
else
  say "no VolumeSnapshot CRDs in this cluster: no VolumeSnapshotClass (install the CRDs and snapshot-controller, then make deploy again)"
fi
say "done"
