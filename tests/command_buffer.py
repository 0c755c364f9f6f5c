"""Checks that an FFI custom call runs inside an XLA command buffer (CUDA graph).

`assert_captured(script, target, tmp_path)` runs `script` in a fresh process (so XLA_FLAGS apply) with
the command-buffer conversion log and an XLA dump on. The script prints `CUSTOM_CALL_NAMES <names>`
(the custom-call instructions of `target` in its compiled HLO) and `LOOP_OK` once its own checks pass.
Evidence of capture: the conversion pass names one of them among a command buffer's thunks, or the
thunk sequence after XLA's passes has it inside a kCommandBuffer.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap


def loop_checks(target: str, same_bits_as: str | None = None, rel_tol: float = 0.03,
                oracle: str = "reference") -> str:
    """The end of a decode-like loop script for `assert_captured`: with `steps(x, backend, pdl)` (a
    loop of calls to `target`, bf16) and `x0` defined, jits it with x donated, prints the
    target's custom-call names, checks that a replay and PDL off give the same bits and that the
    reference is within 8 layers of bf16 roundings (rel_tol of its largest value; and, with
    `same_bits_as`, that steps(x, same_bits_as, True) gives the same bits: another kernel the
    target must equal; `oracle`: the backend steps() compares with, "reference" unless the script's
    steps() names another whose semantics the target shares), and prints LOOP_OK."""
    checks = []
    if same_bits_as is not None:  # the stronger claim first
        checks += [f'other = f(jnp.array(x0), "{same_bits_as}", True)',
                   f'assert np.array_equal(np.asarray(a), np.asarray(other)), "not the bits of {same_bits_as}"']
    checks += [f'ref = np.asarray(f(jnp.array(x0), "{oracle}", False), np.float32)',
               "err = np.abs(np.asarray(a, np.float32) - ref).max() / np.abs(ref).max()",
               f"assert err < {rel_tol}, err  # 8 layers of bf16 roundings apart"]
    checks = "".join("\n        " + line for line in checks)
    return textwrap.dedent(f"""
        f = jax.jit(steps, static_argnums=(1, 2), donate_argnums=0)
        hlo = f.lower(x0, "cuda", True).compile().as_text()
        names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
                 if 'custom_call_target="jax_onnx_attn_{target}"' in l]
        print("CUSTOM_CALL_NAMES", *names)
        a = f(jnp.array(x0), "cuda", True)
        b = f(jnp.array(x0), "cuda", True)  # replay
        c = f(jnp.array(x0), "cuda", False)
        assert np.array_equal(np.asarray(a), np.asarray(b)), "replay changed the bits"
        assert np.array_equal(np.asarray(a), np.asarray(c)), "pdl changed the bits"{checks}
        print("LOOP_OK")
    """)


def prefill_loop(attn_kwargs: str, q_rows: int, kv_rows: int, q_len: tuple, kv_len: tuple) -> str:
    """A loop script for `assert_captured(..., "prefill_attention", ...)`: 8 prefill calls under
    jit (each query the previous output; bf16, B 2, 16 / 4 heads, D 128), `cuda.prefill_attention`
    with `attn_kwargs` (Python source); the replay and the eager loop give the same bits."""
    return textwrap.dedent(f"""
        import functools, jax, jax.numpy as jnp, numpy as np
        from jax_onnx_attn.ops import cuda

        attn = functools.partial(cuda.prefill_attention, {attn_kwargs})
        def steps(q, k, v, q_len, kv_len):
            return jax.lax.fori_loop(0, 8, lambda i, q: attn(q, k, v, q_len, kv_len), q)

        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((2, 16, {q_rows}, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((2, 4, {kv_rows}, 128)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((2, 4, {kv_rows}, 128)), jnp.bfloat16)
        q_len = jnp.array({list(q_len)}, jnp.int32)
        kv_len = jnp.array({list(kv_len)}, jnp.int32)
        f = jax.jit(steps)
        hlo = f.lower(q, k, v, q_len, kv_len).compile().as_text()
        names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
                 if 'custom_call_target="jax_onnx_attn_prefill_attention"' in l]
        print("CUSTOM_CALL_NAMES", *names)
        got = f(q, k, v, q_len, kv_len)
        got2 = f(q, k, v, q_len, kv_len)  # replay
        want = q
        for i in range(8):
            want = attn(want, k, v, q_len, kv_len)
        assert np.array_equal(np.asarray(got), np.asarray(got2))
        assert np.array_equal(np.asarray(got), np.asarray(want)), float(jnp.abs(got - want).max())
        print("LOOP_OK")
    """)


def assert_captured(script: str, target: str, tmp_path) -> None:
    dump = tmp_path / "xla_dump"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    env["TF_CPP_VMODULE"] = "command_buffer_conversion_pass=2,command_buffer_thunk=2"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "LOOP_OK" in run.stdout, log[-4000:]
    names = re.search(r"CUSTOM_CALL_NAMES (.*)", run.stdout).group(1).split()
    assert names, f"the script has no {target} custom call"
    # Evidence 1: the conversion pass lists our custom call among a command buffer's thunks.
    created = [l for l in log.splitlines() if "command buffer" in l.lower() and any(n in l for n in names)]
    # Evidence 2: the thunk sequence after XLA's passes has the custom call inside a command buffer.
    thunk_files = sorted(pathlib.Path(dump).rglob("*thunk_sequence*"))
    in_dump = [f.name for f in thunk_files
               if "kCommandBuffer" in f.read_text() and any(n in f.read_text() for n in names)]
    print("command-buffer log lines:", *created[:5], sep="\n  ")
    print("thunk dumps with the call inside a command buffer:", in_dump)
    assert created or in_dump, (
        f"{target} ({names}) not seen in a command buffer; log tail:\n{log[-3000:]}\n"
        f"thunk files: {[f.name for f in thunk_files]}")
