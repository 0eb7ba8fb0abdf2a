#!/usr/bin/env bash
# Quick start on a fresh Debian/Ubuntu machine, as root, from a checkout:
#
#   deploy/quickstart.sh                install everything, mount a demo lake on
#                                       /mnt/aifs-demo (embedded local-directory lake)
#   deploy/quickstart.sh --install-only install everything, mount nothing (CI)
#
# Installs: apt packages fuse3, libfuse3-dev, pkg-config, a C compiler, the
# Python headers and systemd, and the programs tests/programs runs on a mount
# (rsync, git, sqlite3, fio, unzip, zip, attr); a virtual environment in .venv
# with aifs and its test extras; /usr/local/bin/aifs, the mount helpers
# /sbin/mount.fuse.aifs and /sbin/umount.{fuse.,}aifs, and the systemd unit
# /etc/systemd/system/aifs@.service.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
DEMO_MNT=${AIFS_DEMO_MOUNTPOINT:-/mnt/aifs-demo}
DEMO_LAKE=${AIFS_DEMO_LAKE:-/var/lib/aifs/lake}

need_apt=()
# systemd: systemd-analyze checks the unit file in the tests; rsync ... attr: the
# real programs tests/programs runs on a mount
for pkg in fuse3 libfuse3-dev pkg-config gcc python3-venv python3-dev systemd \
           rsync git sqlite3 fio unzip zip attr; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "installing: ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
echo "aifs installed: $(.venv/bin/aifs --version)"

# System integration: the aifs command, the mount(8)/umount(8) helpers for fstab
# lines of type fuse.aifs, and the systemd unit aifs@NAME (/etc/aifs/NAME.toml).
ln -sfn "$PWD/.venv/bin/aifs" /usr/local/bin/aifs
for helper in mount.fuse.aifs umount.fuse.aifs umount.aifs; do
  ln -sfn "$PWD/mount/mount.aifs" "/sbin/$helper"
done
if [[ -d /etc/systemd/system ]]; then
  install -m 644 deploy/aifs@.service /etc/systemd/system/aifs@.service
  if [[ -d /run/systemd/system ]]; then systemctl daemon-reload || true; fi
fi
mkdir -p /etc/aifs

[[ $MODE == --install-only ]] && exit 0

# A demo lake with a few sample files, on the embedded default (a local directory).
mkdir -p "$DEMO_LAKE/datasets/mnist-sample" "$DEMO_LAKE/models" "$DEMO_MNT"
for i in 0 1 2 3 4 5 6 7; do
  head -c 16384 /dev/urandom > "$DEMO_LAKE/datasets/mnist-sample/sample-$i.bin"
done
echo "aifs demo lake: try ls, cat and dd through the mount" > "$DEMO_LAKE/README.txt"
head -c $((8 << 20)) /dev/urandom > "$DEMO_LAKE/models/weights.bin"
if mountpoint -q "$DEMO_MNT"; then
  .venv/bin/aifs umount "$DEMO_MNT"
fi
.venv/bin/aifs mount "file://$DEMO_LAKE" "$DEMO_MNT"
echo "mounted demo lake file://$DEMO_LAKE on $DEMO_MNT:"
ls -l "$DEMO_MNT"
echo "unmount with: .venv/bin/aifs umount $DEMO_MNT"
