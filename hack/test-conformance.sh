#!/usr/bin/env bash
# test-conformance.sh: Kubernetes' CSI driver suites ("External Storage",
# test/e2e/storage/external) against Cairn on the e2e kind cluster, with the
# driver definition test/driver.yaml and the skip list below (a reason per
# entry). Prints passed / failed / skipped with reasons and exits non-zero
# when a spec fails or none ran.
#
# e2e.test and the suites' test images come from ../shared/tools/k8s-storage-e2e
# (built from Go modules and Debian packages, cached in $K8S_E2E_CACHE,
# outside the clone: the first build takes 20 minutes or more on 2 cores,
# later runs seconds). Without that folder the script says how to get
# e2e.test online and stops.
#
# The cluster kind-$CLUSTER is used as it is; it is brought up with
# hack/kind-up.sh (Cairn deployed from this tree) only when it does not
# exist. Each step that touches it (bring-up, image load, capability probe,
# the run, the clean-up) holds the lock file $LOCK (flock), so that other
# users of the same cluster who take the same lock run between the steps,
# never during one.
#
# Environment:
#   CLUSTER   kind cluster (default cairn-e2e, as make test-e2e)
#   FOCUS     ginkgo focus regex (default every External Storage spec)
#   SLOW      1 (default) runs the [Slow] specs too (every xfs pattern and
#             the multiVolume suite); 0 leaves them out (about half the time)
#   PROCS     parallel ginkgo processes (default 3)
#   OUT       output folder (default _artifacts/conformance): e2e.log,
#             report.json, junit_01.xml, summary.md, skips.md
#   CAP_SKIP  auto (default): skip the online ext4 expansion specs only where
#             the node plugin lacks CAP_SYS_RESOURCE; 0 never skips them
#   LOCK      lock file (default /tmp/kind-$CLUSTER.lock)
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-cairn-e2e}
CTX=kind-$CLUSTER
LOCK=${LOCK:-/tmp/kind-$CLUSTER.lock}
TOOL=${K8S_E2E_TOOL:-../shared/tools/k8s-storage-e2e}
OFFLINE=../shared/tools/kind-offline
export K8S_E2E_CACHE=${K8S_E2E_CACHE:-/var/cache/k8s-e2e}
FOCUS=${FOCUS:-External.Storage}
SLOW=${SLOW:-1}
PROCS=${PROCS:-3}
OUT=${OUT:-_artifacts/conformance}
CAP_SKIP=${CAP_SKIP:-auto}
DRIVER=$PWD/test/driver.yaml
say() { printf '\n\033[1m== %s (%s)\033[0m\n' "$*" "$(date +%T)"; }
locked() { flock "$LOCK" "$@"; }
k() { kubectl --context "$CTX" "$@"; }

# The skip list: "regex<TAB>reason". Ginkgo matches each regex against a
# spec's full text (suite, pattern, spec name and tags).
SKIPS=(
  '\[Disruptive\]	stops or restarts kubelet on a node while a volume is in use: needs a cluster of its own, and the e2e cluster is shared (make test-e2e, the demo, other runs)'
  '\[Serial\]	must run alone on the cluster (stress and performance suites, volume limits, the volume-populator spec, whose populator image is not built here); this run is parallel on a shared cluster'
  '\[Feature:SELinux\]	SELinux mount labels: the kind nodes run without SELinux, and the CSIDriver does not set seLinuxMount'
  '\[Feature:(VolumeGroupSnapshotDataSource|volumegroupsnapshot)\]	volume group snapshots: Cairn has no group controller service'
  '\[Feature:VolumeAttributesClass\]	ControllerModifyVolume: Cairn does not offer MODIFY_VOLUME'
  '\[Feature:Windows\]	Windows nodes: Cairn runs on Linux only'
)
[[ $SLOW == 1 ]] || SKIPS+=('\[Slow\]	SLOW=0: the [Slow] specs (every xfs pattern, the multiVolume suite) are left out of this run')

# capEff FILE: the CapEff mask of a /proc/<pid>/status file, in hex.
capEff() { sed -n 's/^CapEff:[[:space:]]*//p' "$1"; }
# hasCapSysResource HEX: CAP_SYS_RESOURCE is capability 24.
hasCapSysResource() { (( (16#$1 >> 24) & 1 )); }

# nodePluginCaps: the CapEff of the csi container of every node plugin pod,
# one line each; nothing when there is none (or kubectl exec fails).
nodePluginCaps() {
  local p
  for p in $(k -n cairn-system get pods -l app.kubernetes.io/component=csi-node -o name 2>/dev/null); do
    k -n cairn-system exec "$p" -c csi -- cat /proc/self/status 2>/dev/null | sed -n 's/^CapEff:[[:space:]]*//p' || true
  done
}

# capSkips: the online ext4 expansion specs need CAP_SYS_RESOURCE in the
# node plugin (the kernel refuses to grow a mounted ext4 without it; docs/
# csi.md, Growing filesystems). Where any node plugin lacks it, they are
# skipped; elsewhere they run. Read from the node plugins' CapEff, else from
# this machine's (whose kind nodes cannot have more than it has).
capSkips() {
  local caps src c lacking=0
  caps=$(locked bash -c "$(declare -f k nodePluginCaps); CTX=$CTX; nodePluginCaps")
  src="the node plugins (kubectl exec ... cat /proc/self/status)"
  if [[ -z $caps ]]; then
    caps=$(capEff /proc/self/status); src="this machine (/proc/self/status; no node plugin answered)"
  fi
  for c in $caps; do hasCapSysResource "$c" || lacking=1; done
  if [[ $lacking == 1 ]]; then
    CAP_NOTE="CAP_SYS_RESOURCE: missing in $src (CapEff $(echo $caps))"
    [[ $CAP_SKIP == 0 ]] && { CAP_NOTE+="; CAP_SKIP=0: the online ext4 expansion specs run anyway"; return; }
    SKIPS+=('Dynamic PV \((default fs|ext4|ext3)\)\(allowExpansion\)\] volume-expand should resize volume when PVC is edited while pod is using it	grows a mounted ext4, which needs CAP_SYS_RESOURCE; the node plugins lack it here (detected from CapEff, bit 24); NodeExpandVolume refuses with FailedPrecondition and the next stage grows it')
    SKIPS+=('Generic Ephemeral-volume \((default fs|ext4)\).*ephemeral should support expansion of pvcs created for ephemeral pvcs	grows the mounted ext4 of a running pod'"'"'s ephemeral volume, which needs CAP_SYS_RESOURCE; the node plugins lack it here (detected from CapEff, bit 24); NodeExpandVolume refuses with FailedPrecondition naming the capability, and the spec waits 10 minutes for a resize that cannot happen')
  else
    CAP_NOTE="CAP_SYS_RESOURCE: present in $src (CapEff $(echo $caps)): the online ext4 expansion specs run"
  fi
}

# toolsOrExplain: e2e.test, the ginkgo CLI and the test images, built
# offline by the shared tool (cached), or the online recipe.
toolsOrExplain() {
  if [[ ! -d $TOOL ]]; then
    cat >&2 <<EOF
test-conformance: $TOOL is not here, so e2e.test cannot be built offline.
Online, take the e2e.test of the cluster's Kubernetes version:
  v=\$(kubectl --context $CTX version -o json | jq -r .serverVersion.gitVersion)
  curl -L https://dl.k8s.io/release/\$v/kubernetes-test-linux-amd64.tar.gz |
    tar -xz --strip-components=3 kubernetes/test/bin/e2e.test kubernetes/test/bin/ginkgo
  ./ginkgo -p -procs=$PROCS -focus='External.Storage' -skip='<the skip list in $0>' ./e2e.test -- \\
    -context=$CTX -provider=skeleton -storage.testdriver=$DRIVER -repo-root=$(dirname "$DRIVER")
The nodes then pull the test images from registry.k8s.io themselves.
EOF
    exit 2
  fi
  say "e2e.test, agnhost, ginkgo (cached in $K8S_E2E_CACHE/bin; log $K8S_E2E_CACHE/logs/build-e2e.log)"
  mkdir -p "$K8S_E2E_CACHE/logs"
  "$TOOL/build-e2e.sh" >"$K8S_E2E_CACHE/logs/build-e2e.log" 2>&1 ||
    { tail -20 "$K8S_E2E_CACHE/logs/build-e2e.log" >&2; echo "build-e2e.sh failed" >&2; exit 1; }
  say "test images (look-alikes under the upstream names)"
  "$TOOL/build-images.sh" >/dev/null
}

# clusterOrUp: the cluster as it is, or brought up when it does not exist.
clusterOrUp() {
  if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    say "no cluster $CLUSTER: hack/kind-up.sh brings it up with Cairn from this tree"
    CLUSTER=$CLUSTER locked hack/kind-up.sh
  fi
  say "cluster $CLUSTER: nodes, Cairn and the snapshot class"
  locked bash -c "$(declare -f k); CTX=$CTX; set -e
    k wait --for=condition=Ready nodes --all --timeout=60s >/dev/null
    k -n cairn-system rollout status ds/cairn-csi-node --timeout=60s
    k -n cairn-system rollout status deploy/cairn-csi-controller --timeout=60s
    k get volumesnapshotclass cairn -o name" ||
    { echo "cluster $CLUSTER is not ready for the suites (above): make test-e2e KEEP=1 or hack/kind-up.sh sets it up" >&2; exit 1; }
}

# loadImages: the test images into every node, unless every node has them.
loadImages() {
  local n have missing=0
  . "$TOOL/versions.env"
  for n in $(kind get nodes --name "$CLUSTER"); do
    have=$(docker exec "$n" ctr -n k8s.io images ls -q 2>/dev/null)
    for i in "$BUSYBOX_IMAGE" "$AGNHOST_IMAGE" "$NGINX_IMAGE" "$JESSIE_DNSUTILS_IMAGE"; do
      grep -qxF "$i" <<<"$have" || missing=1
    done
  done
  if [[ $missing == 1 ]]; then
    say "loading the test images into the nodes of $CLUSTER"
    locked "$TOOL/load-images.sh" "$CTX"
  fi
}

# cleanLeftovers: namespaces (and their StorageClasses) the suites created
# after START and left behind, as an interrupted or failed run can.
cleanLeftovers() {
  local start=$1 ns
  ns=$(locked kubectl --context "$CTX" get ns -l e2e-framework -o json |
    jq -r --arg t "$start" '.items[] | select(.metadata.creationTimestamp >= $t) | .metadata.name')
  [[ -z $ns ]] && return
  say "deleting what the suites left: namespaces $(echo $ns | tr '\n' ' ')"
  for n in $ns; do
    locked bash -c "$(declare -f k); CTX=$CTX
      k delete ns $n --wait=false
      k get sc -o name | grep '^storageclass.storage.k8s.io/$n-' | xargs -r kubectl --context $CTX delete"
  done
}

# skipReport: how many specs of the focus each skip-list entry left out,
# each spec counted under the first entry that matches it.
skipReport() {
  local r=$OUT/report.json line res=() counts
  for line in "${SKIPS[@]}"; do res+=("${line%%$'\t'*}"); done
  echo "## skip list (reason: specs left out)"
  echo
  echo "$CAP_NOTE"
  echo
  counts=$(jq -n '$ARGS.positional' --args "${res[@]}" | jq --arg f "$FOCUS" --slurpfile r "$r" '. as $res |
    [$r[0][].SpecReports[] | select(.LeafNodeType == "It" and .State == "skipped" and (.Failure.Message // "") == "")
      | ((.ContainerHierarchyTexts // []) + [.LeafNodeText]) | join(" ") | select(test($f))
      | . as $t | first(range($res | length) as $i | select($t | test($res[$i])) | $i)] as $hits
    | [range($res | length) | . as $i | $hits | map(select(. == $i)) | length]' 2>/dev/null || true)
  local i=0
  for line in "${SKIPS[@]}"; do
    echo "- \`${line%%$'\t'*}\`: $(jq -r ".[$i] // \"?\"" <<<"${counts:-[]}") (${line#*$'\t'})"
    i=$((i + 1))
  done
}

if [[ -d $OFFLINE ]]; then
  export KIND_OFFLINE_CACHE=${KIND_OFFLINE_CACHE:-/var/cache/kind-offline}
  export PATH=$KIND_OFFLINE_CACHE/bin:$PATH
fi
for t in docker kind kubectl jq flock; do command -v $t >/dev/null || { echo "test-conformance: $t is needed" >&2; exit 1; }; done
toolsOrExplain
clusterOrUp
loadImages
capSkips
echo "$CAP_NOTE"
SKIP=$(for line in "${SKIPS[@]}"; do printf '%s|' "${line%%$'\t'*}"; done); SKIP=${SKIP%|}
mkdir -p "$OUT"; rm -f "$OUT/report.json"
say "External Storage suites: focus $FOCUS, $PROCS processes (log $OUT/e2e.log)"
start=$(date -u +%Y-%m-%dT%H:%M:%SZ)
rc=0
locked env FOCUS="$FOCUS" SKIP="$SKIP" PROCS="$PROCS" DRIVER="$DRIVER" "$TOOL/run.sh" "$CTX" "$OUT" >"$OUT/run.log" 2>&1 || rc=$?
cleanLeftovers "$start"
skipReport >"$OUT/skips.md"
say "results ($OUT/summary.md, $OUT/skips.md)"
grep -m1 '^e2e rc=' "$OUT/run.log" || true
cat "$OUT/summary.md" "$OUT/skips.md"
ran=$(jq '[.[].SpecReports[] | select(.LeafNodeType == "It" and .State != "skipped")] | length' "$OUT/report.json" 2>/dev/null || echo 0)
if [[ $rc != 0 ]]; then
  echo "test-conformance: failed (e2e.test exit $rc): see the failed specs above and $OUT/e2e.log" >&2
  exit 1
fi
if [[ $ran == 0 ]]; then
  echo "test-conformance: no spec ran (focus $FOCUS)" >&2
  exit 1
fi
echo "test-conformance: $ran specs ran, none failed"
