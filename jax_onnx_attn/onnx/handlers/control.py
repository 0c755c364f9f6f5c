"""Control flow: If.

A condition known at trace time (the usual case: producers branch on shapes, e.g. the builder's
LongRoPE If on the sequence length) runs only the chosen branch. A traced condition runs both
branches and selects, which needs both branches to give the same shapes.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.onnx.registry import register
from jax_onnx_attn.onnx.values import is_static, to_jax


def _pad_rows(x, rows: int):
    """x with its first axis extended to `rows` by repeating its last row."""
    x = to_jax(x)
    return jnp.concatenate([x, jnp.repeat(x[-1:], rows - x.shape[0], axis=0)], axis=0)


def select_branches(ctx, cond, *, pad_rows: bool = False):
    """Both branches of an If, selected on the device by a traced `cond`.

    pad_rows: branches whose outputs differ only in their first axis (tables indexed by position,
    e.g. LongRoPE's short and long cos/sin caches) are padded to the longer one by repeating the
    last row; valid when the condition guarantees the shorter table is only read within its rows.

    Args:
      ctx: the If node's NodeContext (its then_branch / else_branch attributes are run).
      cond: bool, one element (shape [] or [1]), traced.

    Returns:
      One jax array per If output: the then/else outputs (same shape and dtype each, or padded along
      axis 0 with pad_rows) selected by cond.
    """
    then_out = ctx.interp.run_subgraph(ctx.attr("then_branch"), ctx.env)
    else_out = ctx.interp.run_subgraph(ctx.attr("else_branch"), ctx.env)
    c = to_jax(cond).reshape(())
    outs = []
    for name, a, b in zip(ctx.node.output, then_out, else_out):
        if tuple(a.shape) != tuple(b.shape):
            if pad_rows and a.ndim == b.ndim and a.ndim >= 1 and a.shape[1:] == b.shape[1:]:
                rows = max(a.shape[0], b.shape[0])
                a, b = _pad_rows(a, rows), _pad_rows(b, rows)
            else:
                ctx.fail(f"output {name!r}: the branches give shapes {list(a.shape)} and "
                         f"{list(b.shape)} and the condition is only known at run time")
        outs.append(jnp.where(c, to_jax(a), to_jax(b)))
    return tuple(outs)


@register("If", 11, 13, 16, 19, 21, 23, 24, 25)
def if_(ctx, cond):
    """If: only the chosen branch when cond is static, else both branches selected on the device."""
    if is_static(cond):
        branch = ctx.attr("then_branch") if bool(np.asarray(cond).reshape(-1)[0]) else \
            ctx.attr("else_branch")
        return tuple(ctx.interp.run_subgraph(branch, ctx.env))
    return select_branches(ctx, cond)
