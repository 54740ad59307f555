#!/usr/bin/env bash
# envtest.sh: print a directory holding kube-apiserver, etcd and kubectl for
# controller-runtime's envtest (use it as KUBEBUILDER_ASSETS), getting them
# first if needed. Progress goes to stderr.
#
# Where the binaries come from, in order:
#   1. KUBEBUILDER_ASSETS, if it is set and holds the three binaries.
#   2. Built from Go modules with ../shared/tools/envtest/get-envtest-bins.sh
#      (or ENVTEST_BUILD_SCRIPT), when present: this works with only the Go
#      module proxy, no internet. The first build takes 15-25 minutes on two
#      cores; the result is cached in $CAIRN_CACHE/envtest-<k8s>-<etcd>.
#   3. setup-envtest (the usual path on machines with internet), which
#      downloads release binaries into $CAIRN_CACHE/setup-envtest.
# bin/k8s is left as a symlink to the chosen directory.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
LOCALBIN=${LOCALBIN:-$root/bin}
CAIRN_CACHE=${CAIRN_CACHE:-$HOME/.cache/cairn}
K8S=${ENVTEST_K8S_VERSION:-1.37.1}
ETCD=${ENVTEST_ETCD_VERSION:-3.7.3}
SETUP_ENVTEST_VERSION=${SETUP_ENVTEST_VERSION:-release-0.25}
BUILD_SCRIPT=${ENVTEST_BUILD_SCRIPT:-$root/../shared/tools/envtest/get-envtest-bins.sh}

has_bins() { [[ -x "$1/kube-apiserver" && -x "$1/etcd" && -x "$1/kubectl" ]]; }

link() {
  mkdir -p "$LOCALBIN"
  ln -sfn "$1" "$LOCALBIN/k8s"
  echo "$1"
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]] && has_bins "$KUBEBUILDER_ASSETS"; then
  echo "envtest: using KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS" >&2
  link "$KUBEBUILDER_ASSETS"
  exit 0
fi

if [[ -x "$BUILD_SCRIPT" ]]; then
  dest=$CAIRN_CACHE/envtest-$K8S-etcd$ETCD
  if ! has_bins "$dest"; then
    echo "envtest: building kube-apiserver $K8S, etcd $ETCD and kubectl from Go modules into $dest" >&2
    echo "envtest: the first build takes 15-25 minutes on two cores; later runs reuse it" >&2
  fi
  K8S_VERSION=$K8S ETCD_VERSION=$ETCD WITH_KUBECTL=1 "$BUILD_SCRIPT" "$dest" >/dev/null
  link "$dest"
  exit 0
fi

echo "envtest: $BUILD_SCRIPT not found; downloading with setup-envtest" >&2
tool=$CAIRN_CACHE/tools/setup-envtest-$SETUP_ENVTEST_VERSION
if [[ ! -x "$tool" ]]; then
  mkdir -p "$CAIRN_CACHE/tools"
  GOWORK=off GOBIN="$CAIRN_CACHE/tools" go install "sigs.k8s.io/controller-runtime/tools/setup-envtest@$SETUP_ENVTEST_VERSION"
  mv "$CAIRN_CACHE/tools/setup-envtest" "$tool"
fi
dir=$("$tool" use "$K8S" --bin-dir "$CAIRN_CACHE/setup-envtest" -p path)
has_bins "$dir" || { echo "envtest: setup-envtest gave $dir without kube-apiserver, etcd and kubectl" >&2; exit 1; }
link "$dir"
