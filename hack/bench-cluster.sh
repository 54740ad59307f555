#!/usr/bin/env bash
# bench-cluster.sh: what a pod sees of a Cairn volume (test/benchcluster) on
# the e2e kind cluster, brought up (or reused, with this tree deployed) by
# hack/kind-up.sh and kept afterwards. BENCHFLAGS are passed to the
# benchmark (e.g. BENCHFLAGS="--rounds 5 --provision 0"); CAIRN_DATA_BIN is
# the cairn-data binary its engine-socket target runs on this machine
# (make bench-cluster builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
export CLUSTER=${CLUSTER:-cairn-e2e}
source hack/kind-up.sh
export E2E_APP_IMAGE=${E2E_APP_IMAGE:-kind-offline/e2e-tools:local} E2E_FIO_IMAGE=${E2E_FIO_IMAGE:-cairn-e2e-fio:local}
say "fio image $E2E_FIO_IMAGE (FROM $E2E_APP_IMAGE)"
docker build -q --build-arg BASE_IMAGE="$E2E_APP_IMAGE" -t "$E2E_FIO_IMAGE" hack/e2e-fio >/dev/null
kind load docker-image --name "$CLUSTER" "$E2E_FIO_IMAGE" >/dev/null
say "bench-cluster"
# shellcheck disable=SC2086 # BENCHFLAGS is a list of flags
go run ./test/benchcluster --context "kind-$CLUSTER" --image "$E2E_FIO_IMAGE" --cairn-data "${CAIRN_DATA_BIN:-bin/cairn-data}" ${BENCHFLAGS:-}
