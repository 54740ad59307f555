#!/usr/bin/env bash
# install-versitygw.sh: build versitygw (a Go S3 gateway; its posix backend
# serves a directory as S3 buckets) from the Go module proxy into
# $CAIRN_CACHE/versitygw-<version>/versitygw, outside the clone, unless it is
# there already. dataplane/backupstore's tests start it on 127.0.0.1 as the
# real S3 server they back up to (CAIRN_VERSITYGW overrides the path they use).
# Prints the binary's path on stdout; progress goes to stderr.
set -euo pipefail
VERSION=${VERSITYGW_VERSION:-v1.8.0}
CAIRN_CACHE=${CAIRN_CACHE:-$HOME/.cache/cairn}
dest=$CAIRN_CACHE/versitygw-$VERSION
bin=$dest/versitygw
if [[ -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$dest"
echo "versitygw: building github.com/versity/versitygw/cmd/versitygw@$VERSION into $dest (a few minutes on two cores)" >&2
# GOWORK=off and GOFLAGS=-mod=mod: go install module@version builds the
# module with its own go.mod, whatever directory this runs from.
tmp=$(mktemp -d "$dest/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
GOWORK=off GOFLAGS=-mod=mod GOBIN="$tmp" go install "github.com/versity/versitygw/cmd/versitygw@$VERSION" >&2
mv "$tmp/versitygw" "$bin"
echo "$bin"
