# Session 31: does an L2 persisting set-aside slow the one-split decode launch; what a jax process has.
set -uo pipefail
xz -d -c .snap/decode_last_cta.xz > /tmp/decode_last_cta && chmod +x /tmp/decode_last_cta
for mb in 0 12; do echo "== PERSIST_MB=$mb"; PERSIST_MB=$mb timeout 40 /tmp/decode_last_cta one-split 2>&1 | grep -E "persisting|one split|4096"; done
cd /tmp
timeout 40 python3 - <<'PY'
import ctypes, glob, jax, jax.numpy as jnp
x = jnp.ones((1024,)) * 2; x.block_until_ready()
for path in sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so*"))[:1]:
    rt = ctypes.CDLL(path)
    v = ctypes.c_size_t(0)
    err = rt.cudaDeviceGetLimit(ctypes.byref(v), 0x06)  # cudaLimitPersistingL2CacheSize
    print(path, "err", err, "persisting L2 set-aside in a jax process: %.1f MB" % (v.value / 1048576))
PY
