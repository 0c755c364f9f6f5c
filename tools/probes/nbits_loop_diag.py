"""The captured-loop check of the 4-bit fused MLP (tests/gpu/test_gated_mlp_nbits_gpu.py's _LOOP)
against the two slots kernels it replaces as well as the reference: 8 steps x = x + mlp(x), bf16;
prints each path's relative distance from the others after 1, 2, 4 and 8 steps (session 41)."""
import jax, jax.numpy as jnp, numpy as np
from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda_matmul

h, i, block = 2048, 8192, 32
rng = np.random.default_rng(0)


def weights(n, k):
    return (rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8),
            (rng.uniform(0.5, 1.5, (n, k // block)) / (16 * np.sqrt(k))).astype(jnp.bfloat16),
            rng.integers(0, 16, (n, k // block), dtype=np.uint8))


gu = ops.interleave_gate_up_nbits(list(weights(i, h)), list(weights(i, h)))
down = weights(h, i)
gu_rec = jnp.asarray(ops.to_record_layout(*gu))
dn_rec = jnp.asarray(ops.to_slice_record_layout(*down))
gamma = jnp.ones((h,), jnp.bfloat16)
x0 = jax.random.normal(jax.random.PRNGKey(0), (1, h), jnp.bfloat16)


def step(x, how):
    if how == "two":
        hid = cuda_matmul.matmul_nbits_record(x, gu_rec, None, None, gamma, n=2 * i, block_size=block, gated=True)
        return ops.matmul_nbits(hid, *(jnp.asarray(a) for a in down), k=i, n=h, bits=4, block_size=block,
                                residual=x, backend="cuda")
    return ops.gated_mlp_nbits(x, gu_rec, dn_rec, block_size=block, norm_weight=gamma, residual=x, backend=how)


for n in (1, 2, 4, 8):
    out = {}
    for how in ("cuda", "two", "reference"):
        f = jax.jit(lambda x: jax.lax.fori_loop(0, n, lambda _, x: step(x, how), x))
        out[how] = np.asarray(f(x0), np.float32)
    d = lambda a, b: float(np.abs(out[a] - out[b]).max() / np.abs(out[b]).max())
    print(f"steps {n}: max|x| {np.abs(out['reference']).max():.3g}  fused-two {d('cuda', 'two'):.4f}  "
          f"fused-ref {d('cuda', 'reference'):.4f}  two-ref {d('two', 'reference'):.4f}", flush=True)
