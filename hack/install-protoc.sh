#!/usr/bin/env bash
# install-protoc.sh: make sure protoc (Debian's protobuf-compiler, with the
# well-known types) is installed; install it with apt when it is not.
set -euo pipefail
if command -v protoc >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "protoc not found: install protobuf-compiler (3.21 or later) with your package manager" >&2
  exit 1
fi
SUDO=""
[[ $(id -u) == 0 ]] || SUDO=sudo
echo "installing protoc (Debian package protobuf-compiler)" >&2
$SUDO apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends protobuf-compiler >&2
