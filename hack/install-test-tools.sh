#!/usr/bin/env bash
# install-test-tools.sh: make sure the real clients the tests, the demo and
# the benchmarks drive are installed: qemu-io/qemu-nbd (qemu-utils), nbdinfo
# (libnbd-bin), fio, e2fsprogs (mkfs.ext4, e2fsck), xfsprogs (mkfs.xfs,
# xfs_growfs, for the CSI driver's xfs volumes), iptables (the chaos
# harness's partitions) and user-mode-linux (a kernel with the nbd driver
# for the /dev/nbdN tests, dataplane/internal/uml) and chromium (a headless
# browser that loads the manager's web page). Installs missing ones
# with apt as root; otherwise prints the command to run.
set -euo pipefail
declare -A pkg=([qemu-io]=qemu-utils [qemu-nbd]=qemu-utils [nbdinfo]=libnbd-bin [fio]=fio [mkfs.ext4]=e2fsprogs [e2fsck]=e2fsprogs [mkfs.xfs]=xfsprogs [xfs_growfs]=xfsprogs [iptables]=iptables [linux.uml]=user-mode-linux [chromium]=chromium)
missing=()
for tool in "${!pkg[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${pkg[$tool]}")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "missing tools; install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "installing ${missing[*]}" >&2
apt-get update -qq >&2 || true
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
