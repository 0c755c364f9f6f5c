#!/usr/bin/env bash
# Device session helper: prepare the carried snapshot (tools/device_prepare.sh), then run the
# decode profile set (bench rows + ncu) into $OUT.
# Usage on the GPU machine: bash tools/device_profile.sh
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider tests/gpu/test_decode_attention_gpu.py -k "pos_shift or bitwise" 2>&1 | tail -3
B="python3 -m jax_onnx_attn.bench decode --heads 32/8 --dims 128 --dtypes bf16 --impls ours jax-cudnn torch-cudnn --reps 5"
$B --batch 1 --ctx 1024 4096 8192 --qlen 1 16 --out "$out/b1.json" 2>&1 | grep -E "^B=|x"
JOA_BENCH_DONATE=0 $B --batch 1 --ctx 1024 --qlen 1 --impls ours jax-cudnn 2>&1 | grep -E "^B="
$B --batch 8 32 --ctx 8192 131072 --qlen 1 16 --max-seconds 60 --out "$out/big.json" 2>&1 | grep -E "^B="
N="ncu --clock-control none -k regex:Decode --set full"
P="python3 tools/profile_decode.py"
$N --launch-skip 4 --launch-count 2 $P --batch 1 --ctx 1024 > "$out/ncu_b1_1k.txt" 2>&1
$N --launch-skip 2 --launch-count 1 $P --batch 8 --ctx 131072 --iters 4 > "$out/ncu_b8_128k.txt" 2>&1
$N --launch-skip 2 --launch-count 1 $P --batch 32 --ctx 8192 --qlen 16 --iters 4 > "$out/ncu_b32_8k_q16.txt" 2>&1
$N --launch-skip 2 --launch-count 1 $P --batch 32 --ctx 8192 --qlen 4 --iters 4 > "$out/ncu_b32_8k_q4.txt" 2>&1
ls -la "$out"; grep -h -E "Duration|DRAM Throughput|Memory Throughput" "$out"/ncu_*.txt | head -40
