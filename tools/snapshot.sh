#!/usr/bin/env bash
# Writes a tree for the device scripts (tools/device_*.sh) to .snap/: carry ".snap" in the device call.
#   bash tools/snapshot.sh [--tree] [--so PATH] [REV]
# Default: the committed tree of REV (HEAD), its id in .snap/COMMIT. --tree: the working tree
# (tracked + untracked, not ignored; COMMIT = HEAD+wip) for experiments. --so: a prebuilt extension
# for the device's Python (tools/build_device_ext.sh), xz-packed (it is ~66 MB, over what a call
# carries); the device scripts unpack and use it instead of building there (~100 s of device time).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tree=0; so=""; rev=HEAD
while [ $# -gt 0 ]; do
  case "$1" in
    --tree) tree=1 ;;
    --so) so=$2; shift ;;
    *) rev=$1 ;;
  esac
  shift
done
rm -rf .snap && mkdir .snap
if [ $tree = 1 ]; then
  git ls-files -co --exclude-standard -z | xargs -0 tar -cf - | tar -xf - -C .snap
  echo "$(git rev-parse --short HEAD)+wip" > .snap/COMMIT
else
  git archive "$rev" | tar -x -C .snap
  git rev-parse --short "$rev" > .snap/COMMIT
fi
if [ -n "$so" ]; then
  xz -T2 -6 -c "$so" > ".snap/jax_onnx_attn/$(basename "$so").xz"
  (cd .snap && sha256sum jax_onnx_attn/*.so.xz > PREBUILT.sha256)  # checked on the device
fi
echo "snapshot of $(cat .snap/COMMIT) in .snap ($(du -sh .snap | cut -f1))${so:+, prebuilt $(basename "$so")}"
