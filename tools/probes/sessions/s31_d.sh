# Session 31: the decode kernels in a raw CUDA graph against XLA (run from the repository root with .snap and the probe binary carried).
set -uo pipefail
out=${OUT:-/tmp}
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa
for n in 128 32; do
  echo "== XLA chain, $n calls a jit"; (cd tools/probes && timeout 200 python3 decode_xla_chain.py $out/xla_chain_$n.json $n) 2>&1 | grep -v Warn | tail -4
done
echo "== bench decode (its harness: 32 calls a jit)"
timeout 60 python3 -m jax_onnx_attn.bench decode --batch 1 --ctx 2304 4096 8192 --qlen 1 --heads 32/8 --dims 128 \
  --dtypes bf16 --impls ours jax-cudnn --target-ms 10 --reps 5 --max-seconds 50 2>&1 | grep -E "^B=1" | tail -3
