#!/usr/bin/env bash
# kind-up.sh: a three-node kind cluster ($CLUSTER) with Cairn deployed from
# images built from this tree: what `make demo` and `make test-e2e`
# start from. The cluster is reused if it exists. Where
# ../shared/tools/kind-offline sits beside the clone (machines without
# registry access) it builds the kind node image and the CSI sidecars
# first: minutes the first time. Source it or run it; it leaves the
# kubectl context kind-$CLUSTER current. The images are $IMG, $DATA_IMG and
# $CSI_IMG (default the :dev tags, as in the Makefile): give other tags to
# keep a second cluster's images apart from another run's. `make deploy`
# writes them into config/*/kustomization.yaml; do not commit other tags.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CLUSTER=${CLUSTER:-cairn}
export IMG=${IMG:-cairn-manager:dev} DATA_IMG=${DATA_IMG:-cairn-data:dev} CSI_IMG=${CSI_IMG:-cairn-csi:dev}
OFFLINE=../shared/tools/kind-offline
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

if [[ -d $OFFLINE ]]; then
  export KIND_OFFLINE_CACHE=${KIND_OFFLINE_CACHE:-/var/cache/kind-offline}
  export PATH=$KIND_OFFLINE_CACHE/bin:$PATH
  say "docker and the kind node image (built from Go modules and Debian packages; the first run takes 15 to 40 minutes, later ones seconds; log: $KIND_OFFLINE_CACHE/build.log)"
  "$OFFLINE/setup-docker.sh" >/dev/null
  "$OFFLINE/build-node-image.sh" >"$KIND_OFFLINE_CACHE/build.log" 2>&1 &
  build=$!
  while kill -0 $build 2>/dev/null; do sleep 15; echo "   ... $(tail -1 "$KIND_OFFLINE_CACHE/build.log" | cut -c1-100)"; done
  wait $build || { echo "node image build failed: see $KIND_OFFLINE_CACHE/build.log" >&2; exit 1; }
  NODE_IMAGE=${NODE_IMAGE:-kindest/node:v1.35.4-offline}
fi
for t in docker kind kubectl; do command -v $t >/dev/null || { echo "kind-up: $t is needed" >&2; exit 1; }; done
k() { kubectl --context "kind-$CLUSTER" "$@"; }

say "cluster $CLUSTER: three schedulable nodes"
existed=true
create() {
  existed=false
  kind create cluster --name "$CLUSTER" ${NODE_IMAGE:+--image "$NODE_IMAGE"} --config test/e2e/kind-config.yaml --wait 5m
}
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  create
elif ! kind export kubeconfig --name "$CLUSTER" >/dev/null 2>&1 || ! k get nodes >/dev/null 2>&1; then
  # Left by a run that was stopped midway (its node containers stopped
  # with Docker, or its kubeconfig context gone): start afresh.
  echo "kind-up: cluster $CLUSTER exists but its API server does not answer: deleting it and creating it again" >&2
  kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  create
fi
k get nodes

say "images: make docker-build, loaded into the nodes"
image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }
declare -A before
for i in "$IMG" "$DATA_IMG" "$CSI_IMG"; do before[$i]=$(image_id "$i"); done
make -s docker-build IMG="$IMG" DATA_IMG="$DATA_IMG" CSI_IMG="$CSI_IMG" >/dev/null
if [[ -d $OFFLINE ]]; then
  "$OFFLINE/load-images.sh" "$CLUSTER" "$IMG" "$DATA_IMG" "$CSI_IMG" >/dev/null
else
  kind load docker-image --name "$CLUSTER" "$IMG" "$DATA_IMG" "$CSI_IMG" >/dev/null
fi

say "deploy Cairn"
export KUBECONFIG=${KUBECONFIG:-$HOME/.kube/config}
kubectl config use-context "kind-$CLUSTER" >/dev/null
k get crd volumesnapshots.snapshot.storage.k8s.io >/dev/null 2>&1 || make -s deploy-snapshot-controller >/dev/null
make -s deploy IMG="$IMG" DATA_IMG="$DATA_IMG" CSI_IMG="$CSI_IMG" >/dev/null
# A tag that did not change (the :dev default) does not change the pod
# templates, so pods of a live cluster would keep running the old build:
# restart the workloads whose image was rebuilt with other content. The
# instance managers restart as in an upgrade (attached volumes pause).
restart=()
[[ ${before[$IMG]} != "$(image_id "$IMG")" ]] && restart+=(deploy/cairn-manager)
[[ ${before[$DATA_IMG]} != "$(image_id "$DATA_IMG")" ]] && restart+=(ds/cairn-instance-manager ds/cairn-csi-node)
[[ ${before[$CSI_IMG]} != "$(image_id "$CSI_IMG")" ]] && restart+=(ds/cairn-csi-node deploy/cairn-csi-controller)
$existed || restart=()
for w in $(printf '%s\n' "${restart[@]}" | sort -u); do
  k -n cairn-system get "$w" >/dev/null 2>&1 && { say "restart $w: its image was rebuilt"; k -n cairn-system rollout restart "$w"; }
done
k -n cairn-system rollout status ds/cairn-instance-manager --timeout=3m
k -n cairn-system rollout status ds/cairn-csi-node --timeout=3m
k -n cairn-system rollout status deploy/cairn-manager deploy/cairn-csi-controller --timeout=3m 2>/dev/null || \
  { k -n cairn-system rollout status deploy/cairn-manager --timeout=3m; k -n cairn-system rollout status deploy/cairn-csi-controller --timeout=3m; }
k -n cairn-system get pods -o wide

