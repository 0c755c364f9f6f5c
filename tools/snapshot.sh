#!/usr/bin/env bash
# Writes the committed tree of REV (default HEAD) to .snap/ with its id in .snap/COMMIT, for the
# device scripts (tools/device_*.sh) to build: carry ".snap" in the device call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rev=${1:-HEAD}
rm -rf .snap && mkdir .snap && git archive "$rev" | tar -x -C .snap
git rev-parse --short "$rev" > .snap/COMMIT
echo "snapshot of $(cat .snap/COMMIT) in .snap ($(du -sh .snap | cut -f1))"
