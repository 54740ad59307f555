#!/usr/bin/env bash
# test-e2e.sh: the e2e suite (test/e2e, build tag e2e) on a three-node kind
# cluster with Cairn deployed from this tree (hack/kind-up.sh). The cluster
# is deleted afterwards unless KEEP=1. Some specs stop a worker node
# (docker stop) and start it again; none stops the control plane. On failure, every Cairn object and
# the logs of Cairn's pods go to $ARTIFACTS (default _artifacts/e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
export CLUSTER=${CLUSTER:-cairn-e2e}
ARTIFACTS=${ARTIFACTS:-_artifacts/e2e}
# kubelet in the kind nodes changes these host-wide sysctls; put them back.
saved=$(sysctl -n kernel.panic kernel.panic_on_oops vm.overcommit_memory 2>/dev/null | tr '\n' ' ' || true)
cleanup() {
  if [[ ${KEEP:-0} != 1 ]]; then
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    if [[ -n $saved && $(id -u) == 0 ]]; then
      read -r p o m <<<"$saved"
      sysctl -qw kernel.panic="$p" kernel.panic_on_oops="$o" vm.overcommit_memory="$m" || true
    fi
  else
    echo "KEEP=1: cluster $CLUSTER kept (kubectl --context kind-$CLUSTER ...; kind delete cluster --name $CLUSTER)"
  fi
}
trap cleanup EXIT
source hack/kind-up.sh

# The suite's pods run $E2E_APP_IMAGE; its fio spec runs that image with
# Debian's fio added (hack/e2e-fio), built here and loaded into the nodes.
export E2E_APP_IMAGE=${E2E_APP_IMAGE:-kind-offline/e2e-tools:local} E2E_FIO_IMAGE=${E2E_FIO_IMAGE:-cairn-e2e-fio:local}
say "fio image $E2E_FIO_IMAGE (FROM $E2E_APP_IMAGE)"
docker build -q --build-arg BASE_IMAGE="$E2E_APP_IMAGE" -t "$E2E_FIO_IMAGE" hack/e2e-fio >/dev/null
kind load docker-image --name "$CLUSTER" "$E2E_FIO_IMAGE" >/dev/null
# Its backup spec runs versitygw (hack/e2e-s3) in the cluster as the S3 target.
export E2E_S3_IMAGE=${E2E_S3_IMAGE:-cairn-e2e-s3:local}
say "S3 server image $E2E_S3_IMAGE (versitygw, FROM $E2E_APP_IMAGE)"
hack/s3-image.sh "$E2E_S3_IMAGE" "$E2E_APP_IMAGE" "$CLUSTER"

say "e2e suite"
rc=0
# -v streams the specs' progress (ginkgo -v) to the log as they run;
# E2E_FOCUS (a regular expression over spec texts) runs only those specs.
go test -v -tags e2e -count=1 -timeout 60m ./test/e2e -args -ginkgo.v ${E2E_FOCUS:+-ginkgo.focus="$E2E_FOCUS"} || rc=$?
# A short whole-stack fault schedule (docs/reliability.md, "Cluster fault
# schedules"): three faults drawn from a seed it prints, 4 to 10 minutes.
if [[ $rc == 0 && -z ${E2E_FOCUS:-} ]]; then
  say "cluster fault schedule"
  make -s chaos-cluster SCHEDULES=1 STEPS=3 SEED="${CHAOS_SEED:-0}" || rc=$?
fi
if [[ $rc != 0 ]]; then
  mkdir -p "$ARTIFACTS"
  k() { kubectl --context "kind-$CLUSTER" "$@"; }
  k get all,pvc,pv,volumeattachments,volumesnapshots -A -o wide >"$ARTIFACTS/get.txt" 2>&1 || true
  k -n cairn-system get volumes,engines,replicas,snapshots,instancemanagers,storagenodes -o yaml >"$ARTIFACTS/cairn.yaml" 2>&1 || true
  k get events -A --sort-by=.lastTimestamp >"$ARTIFACTS/events.txt" 2>&1 || true
  for p in $(k -n cairn-system get pods -o name); do
    k -n cairn-system logs "$p" --all-containers --prefix >"$ARTIFACTS/$(basename "$p").log" 2>&1 || true
  done
  echo "e2e failed: objects and logs in $ARTIFACTS" >&2
fi
exit $rc
