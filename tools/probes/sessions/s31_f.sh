# Session 31: the one-split decode launch with its K / V shifted off cudaMalloc alignment; jax arrays alignment.
set -uo pipefail
xz -d -c .snap/decode_last_cta.xz > /tmp/decode_last_cta && chmod +x /tmp/decode_last_cta
for sh in 0 16 64 128 256; do /tmp/decode_last_cta one-split+$sh 2>&1 | grep "one split"; done
source .snap/tools/device_prepare.sh > /dev/null 2>&1 || true
cd /tmp/joa
python3 - <<'PY'
import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
ks = [jnp.asarray(rng.standard_normal((1, 8, 4096, 128)), jnp.bfloat16) for _ in range(4)]
print("jax array addresses mod 4096:", [a.unsafe_buffer_pointer() % 4096 for a in ks])
PY
