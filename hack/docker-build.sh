#!/usr/bin/env bash
# docker-build.sh: build Cairn's three images from the binaries `make build`
# put in bin/: the manager ($IMG, FROM $BASE_IMAGE: static, distroless by
# default), the data plane ($DATA_IMG) and the CSI driver ($CSI_IMG), both
# FROM $NODE_BASE_IMAGE (Debian bookworm; they install what they run with
# apt). An empty base means: the public default, or, where that cannot be
# pulled and kind-offline has built its local Debian ($OFFLINE_BASE), that
# one (and scratch for the manager).
set -euo pipefail
: "${CONTAINER_TOOL:=docker}" "${IMG:=cairn-manager:dev}" "${DATA_IMG:=cairn-data:dev}" "${CSI_IMG:=cairn-csi:dev}"
: "${OFFLINE_BASE:=kind-offline/debian:bookworm}"
base=${BASE_IMAGE:-} node_base=${NODE_BASE_IMAGE:-}
if [[ -z $base || -z $node_base ]]; then
  if $CONTAINER_TOOL image inspect "$OFFLINE_BASE" >/dev/null 2>&1; then
    echo "docker-build: using the locally built $OFFLINE_BASE (and scratch for the manager)" >&2
    base=${base:-scratch} node_base=${node_base:-$OFFLINE_BASE}
  else
    base=${base:-gcr.io/distroless/static:nonroot} node_base=${node_base:-debian:bookworm-slim}
  fi
fi
$CONTAINER_TOOL build --build-arg BASE_IMAGE="$base" -t "$IMG" -f Dockerfile .
$CONTAINER_TOOL build --build-arg BASE_IMAGE="$node_base" -t "$DATA_IMG" -f Dockerfile.data .
$CONTAINER_TOOL build --build-arg BASE_IMAGE="$node_base" -t "$CSI_IMG" -f Dockerfile.csi .
echo "built $IMG $DATA_IMG $CSI_IMG" >&2
