#!/usr/bin/env bash
# verify-generated.sh: regenerate code and manifests (make manifests generate)
# and fail if that changed any generated file. It compares file contents
# before and after, so it works on a tree with uncommitted edits too.
set -euo pipefail
cd "$(dirname "$0")/.."

generated() {
  # Every file a generator writes. Keep in step with the Makefile's
  # manifests and generate targets (and, later, the protobuf outputs).
  find api -name 'zz_generated.*.go'
  find config/crd/bases -name '*.yaml'
  echo config/rbac/role.yaml
  find dataplane/api -name '*.pb.go' 2>/dev/null || true
}

before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
while read -r f; do
  [[ -f "$f" ]] || continue
  mkdir -p "$before/$(dirname "$f")"
  cp "$f" "$before/$f"
done < <(generated)

${MAKE:-make} --no-print-directory manifests generate >/dev/null

after=$(mktemp -d)
trap 'rm -rf "$before" "$after"' EXIT
while read -r f; do
  [[ -f "$f" ]] || continue
  mkdir -p "$after/$(dirname "$f")"
  cp "$f" "$after/$f"
done < <(generated)

if ! diff -ru "$before" "$after" >/tmp/cairn-verify.diff 2>&1; then
  sed -e "s#$before/##g" -e "s#$after/##g" /tmp/cairn-verify.diff | head -60
  echo
  echo "verify: generated files were out of date; 'make manifests generate' has now rewritten them."
  echo "verify: review and commit the regenerated files."
  exit 1
fi
echo "verify: generated code and manifests are up to date"
