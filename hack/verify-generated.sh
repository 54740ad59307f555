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

# copy_generated DIR: copy every generated file into DIR, keeping paths.
copy_generated() {
  while read -r f; do
    [[ -f "$f" ]] || continue
    mkdir -p "$1/$(dirname "$f")"
    cp "$f" "$1/$f"
  done < <(generated)
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
before=$work/before after=$work/after
copy_generated "$before"
${MAKE:-make} --no-print-directory manifests generate >/dev/null
copy_generated "$after"

if ! diff -ru "$before" "$after" >"$work/diff" 2>&1; then
  sed -e "s#$before/##g" -e "s#$after/##g" "$work/diff" | head -60
  echo
  echo "verify: generated files were out of date; 'make manifests generate' has now rewritten them."
  echo "verify: review and commit the regenerated files."
  exit 1
fi
echo "verify: generated code and manifests are up to date"
