# Session 31: the decode kernels in a raw CUDA graph against XLA (run from the repository root with .snap and the probe binary carried).
set -uo pipefail
out=${OUT:-/tmp}
xz -d -c .snap/decode_last_cta.xz > /tmp/decode_last_cta && chmod +x /tmp/decode_last_cta
echo "== raw graph, planned splits"; /tmp/decode_last_cta | tee $out/raw.txt
echo "== raw graph, one split"; /tmp/decode_last_cta one-split | tee -a $out/raw.txt
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa
echo "== XLA chain"; (cd tools/probes && timeout 150 python3 decode_xla_chain.py $out/xla_chain.json) 2>&1 | grep -v Warn | tail -5
