# Session 31: one-split decode in XLA with normal vs uniform data (is the XLA-vs-raw gap the data?).
set -uo pipefail
out=${OUT:-/tmp}
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa
(cd tools/probes && timeout 200 python3 decode_xla_chain.py $out/xla_data.json 128 data) 2>&1 | grep -v Warn | tail -5
