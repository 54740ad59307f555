#!/usr/bin/env bash
# go-install-tool.sh TARGET PACKAGE VERSION
# Installs PACKAGE@VERSION with `go install` and puts it at TARGET (a path
# that carries the version, such as bin/controller-gen-v0.23.0), plus a
# version-less symlink beside it. The build is cached in
# $CAIRN_CACHE/tools/<name>-<version> so a fresh clone reuses it.
set -euo pipefail
target=${1:?usage: $0 TARGET PACKAGE VERSION}
pkg=${2:?package}
version=${3:?version}
cache=${CAIRN_CACHE:-$HOME/.cache/cairn}/tools
name=$(basename "$target")
mkdir -p "$cache" "$(dirname "$target")"
if [[ ! -x "$cache/$name" ]]; then
  echo "installing $pkg@$version" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  GOWORK=off GOBIN="$tmp" go install "$pkg@$version"
  mv "$tmp/$(basename "${pkg%/v[0-9]*}")" "$cache/$name"
fi
ln -sf "$cache/$name" "$target"
ln -sf "$(basename "$target")" "$(dirname "$target")/${name%-"$version"}"
