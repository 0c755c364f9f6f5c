# Session 31: bench decode under XLA command-buffer flags (run from the repository root with .snap carried).
set -uo pipefail
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa 2>/dev/null || true
out=${OUT:-/tmp}
for flags in "" "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE" "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" "--xla_gpu_command_buffer_scheduling_mode=LHS" "--xla_gpu_graph_enable_concurrent_region=true" "--xla_gpu_enable_command_buffer_va_remapping=true"; do
  echo "== XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 60 python3 -m jax_onnx_attn.bench decode --batch 1 --ctx 4096 8192 --qlen 1 --heads 32/8 \
    --dims 128 --dtypes bf16 --impls ours --target-ms 10 --reps 5 --max-seconds 50 2>&1 | grep -E "^B=1|rror" | head -3
done
for flags in "" "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE" "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"; do
  echo "== e2e XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 100 python3 -m jax_onnx_attn.bench e2e --phases decode --models 1b --weights fp16 --batch 1 \
    --ctx 1024 --impls ours --profile none --no-verify --max-seconds 90 --models-dir /tmp/models \
    --out "$out/e2e_1b_$(echo "$flags" | tr -dc 'A-Z' | head -c 12).json" 2>&1 | grep -E "decode  |rror" | head -4
done
