#!/usr/bin/env bash
# s3-image.sh IMAGE BASE_IMAGE CLUSTER: build the in-cluster S3 server
# image (hack/e2e-s3: versitygw, built from the Go module proxy by
# hack/install-versitygw.sh and cached outside the clone) FROM BASE_IMAGE,
# and load it into the kind cluster's nodes. The e2e suite's backup spec and
# `make demo` run it as their backup target.
set -euo pipefail
cd "$(dirname "$0")/.."
image=$1 base=$2 cluster=$3
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp hack/e2e-s3/Dockerfile "$(hack/install-versitygw.sh)" "$ctx/"
docker build -q --build-arg BASE_IMAGE="$base" -t "$image" "$ctx" >/dev/null
kind load docker-image --name "$cluster" "$image" >/dev/null
