# Session 31: bench decode under XLA command-buffer flags (run from the repository root with .snap carried).
set -uo pipefail
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa 2>/dev/null || true
for flags in "" "--xla_gpu_enable_command_buffer=" "--xla_gpu_graph_min_graph_size=1" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"; do
  echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 60 python3 -m jax_onnx_attn.bench decode --batch 1 --ctx 4096 8192 --qlen 1 --heads 32/8 \
    --dims 128 --dtypes bf16 --impls ours jax-cudnn --target-ms 10 --reps 5 --max-seconds 50 2>&1 | grep -E "^B=1" | head -4
done
