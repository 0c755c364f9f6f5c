"""Where a decode step's time goes against its bandwidth bound, from a `bench e2e` JSON's profile.

    python -m jax_onnx_attn.bench breakdown bench/results/FILE.json [--impl ours] [--hbm BYTES_PER_S]

For each decode case whose `impl` was profiled (`bench e2e --profile first|all`), the kernels of
one traced call are grouped by what they do (the GEMV kernels by their input / epilogue policy, our
attention and gqa_prepare by name, the rest together), and each group's device µs a step is set
beside the µs its bytes take at the HBM bandwidth the run's bound used (its --hbm): the
projections' weight bytes (from the model's shapes and its bytes a weight, so int4 weights count
with their scales) and the KV cache's bytes.
"over bound" is what a group costs beyond streaming its bytes: fixed costs a launch, ramp and
drain, low achieved bandwidth. Profiles since session 43 also give each group's wall time ("µs
wall": what its kernels add to the union of kernel intervals), and then "over bound" is of that:
a programmatically dependent launch (our decode combine kernel, XLA's chained kernels) starts
while its predecessor runs, so its duration counts that wait too (summed, the ~8B attention's split
+ combine read 13.8 µs a layer where the call takes ~8.5). This is the profile that explains a
case's fraction of the bound (issue 12). The groups follow our kernels' names; a peer's kernels land in "other".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jax_onnx_attn.bench.decode import align_rows
from jax_onnx_attn.runtime.roofline import H200_HBM_BYTES_PER_S

#: (group, test on a kernel name): the first group whose test matches takes the kernel.
GROUPS = (
    # Gate-up and down in one kernel (ops.gated_mlp): MlpRowKernel (K split), RowChainKernel (N split;
    # with the attention's output projection too under out_mlp, the record's "out_mlp"); MlpRowNKernel
    # is the N split's kernel in profiles from before session 39's row chain; MlpNbitsKernel the
    # 4-bit one in the profiles of sessions 41-43 (taken out: tools/patches/fused-mlp-nbits/).
    ("mlp (fused)", lambda n: any(k in n for k in ("MlpRowKernel", "RowChainKernel", "MlpRowNKernel",
                                                     "MlpNbitsKernel"))),
    ("gate-up", lambda n: "GatedSiluEpilogue" in n),
    ("qkv + LM head", lambda n: "RmsNormInput" in n or "QkvRotaryEpilogue" in n),  # the fused prepare too
    ("o + down", lambda n: "PlainInput" in n),
    ("attention", lambda n: "joa::decode::" in n or "DecodeSplit" in n or "DecodeCombine" in n),
    ("gqa_prepare", lambda n: "GqaPrepare" in n),
)
OTHER = "other"
#: The profiled idle time split (e2e.kernel_timeline): gaps of at most e2e.SHORT_GAP_US (kernel
#: boundaries, their count as calls) and the longer waits on the host.
IDLE_BOUNDARIES = "  between kernels"
IDLE_HOST = "  host waits"
#: The timed step less the profiled kernels: what the unprofiled (command-buffer) step spends
#: outside kernels, if the kernels last as long there.
TIMED_NOT_KERNELS = "step - kernels"


def group_of(name: str) -> str:
    """The group of a kernel name (GROUPS), else "other"."""
    return next((g for g, test in GROUPS if test(name)), OTHER)


def group_bytes(config: dict, step_cost: dict, batch: int, ctx: int, fused_mlp: bool = False,
                out_mlp: bool = False) -> dict[str, float]:
    """Bytes a decode step reads per group: weights from the model's shapes times its bytes a
    weight (the step cost's matmul bytes over its matmul parameters: 2 for f16, 0.5625 for int4
    with f16 scales a 32-block), the KV cache's from its bytes a token (all layers, K and V).
    fused_mlp: the gate-up and down weights are the fused MLP kernel's; out_mlp: o's too."""
    h, layers = config["hidden"], config["layers"]
    d = config["head_size"]
    qkv = h * (config["heads"] + 2 * config["kv_heads"]) * d
    o = config["heads"] * d * h
    gate_up = h * 2 * config["intermediate"]
    down = config["intermediate"] * h
    head = step_cost["head_params"]
    per_param = (step_cost["breakdown"]["matmul"] + step_cost["breakdown"]["matmul_nbits"]) / step_cost["matmul_params"]
    o_in_mlp = fused_mlp and out_mlp
    mlp = (gate_up + down + (o if o_in_mlp else 0)) if fused_mlp else 0
    return {"mlp (fused)": layers * mlp * per_param, "gate-up": 0.0 if fused_mlp else layers * gate_up * per_param,
            "qkv + LM head": (layers * qkv + head) * per_param,
            "o + down": layers * ((0 if o_in_mlp else o) + (0 if fused_mlp else down)) * per_param,
            "attention": float(step_cost["kv_bytes_per_token"]) * ctx * batch, "gqa_prepare": 0.0, OTHER: 0.0}


def step_breakdown(doc: dict, record: dict, impl: str = "ours", hbm: float | None = None) -> list[dict] | None:
    """Rows {group, calls, us, wall_us, mb, tbs, bound_us, over_us} a decode step of `record` (a result of
    `doc`, a bench e2e JSON) for `impl`, bounds at `hbm` bytes/s (None: the run's own --hbm, else
    the H200's), groups in GROUPS order then "other" (kernels outside the
    profile's top list included there, from its total), then "kernels" (their sum), "idle, profiled"
    (span - busy: the device waiting, in the profiled run, which widens those gaps), split where the
    profile says into gaps between kernels (IDLE_BOUNDARIES) and waits on the host (IDLE_HOST), then
    "step (timed)" and the timed step less "kernels" (TIMED_NOT_KERNELS, the unprofiled figure).
    wall_us (None in profiles before session 43): the group's wall time (`e2e.kernel_wall_times`);
    where given, tbs and over_us are of it, and "kernels" is the busy time. None when `impl` has no
    profile."""
    prof = record.get("impls", {}).get(impl, {}).get("profile") or {}
    if not prof.get("top_time"):
        return None
    steps = record["steps_per_call"]
    model = doc["models"][f"{record['model_alias']}/{record['weights']}"]
    fused = any(group_of(name) == "mlp (fused)" for name, _, _ in prof["top_time"])
    nbytes = group_bytes(model["config"], model["step_cost"], record["batch"], record["ctx"], fused,
                         bool(record["impls"][impl].get("out_mlp")))
    walls = dict(prof["top_wall"]) if prof.get("top_wall") else None  # e2e.kernel_wall_times
    acc = {g: [0, 0.0, 0.0] for g, _ in GROUPS} | {OTHER: [0, 0.0, 0.0]}
    for name, count, total in prof["top_time"]:
        a = acc[group_of(name)]
        a[0] += count
        a[1] += total
        a[2] += walls.get(name, 0.0) if walls else 0.0
    listed, listed_wall = sum(a[1] for a in acc.values()), sum(a[2] for a in acc.values())
    acc[OTHER][1] += max(0.0, float(prof.get("total_us", listed)) - listed)
    if walls:
        acc[OTHER][2] += max(0.0, float(prof.get("busy_us", listed_wall)) - listed_wall)
    if hbm is None:
        hbm = doc.get("args", {}).get("hbm") or H200_HBM_BYTES_PER_S
    rows: list[dict] = []
    for g, (count, total, wall) in acc.items():
        us = total / steps
        spent = wall / steps if walls else us  # what the group adds to the step
        b = nbytes[g]
        bound = b / hbm * 1e6
        rows.append({"group": g, "calls": count / steps, "us": us, "wall_us": wall / steps if walls else None,
                     "mb": b / 1e6, "tbs": b / (spent * 1e6) if spent > 0 and b else None, "bound_us": bound,
                     "over_us": spent - bound})
    kernels = sum(r["us"] for r in rows)
    busy = sum(r["wall_us"] for r in rows) if walls else None
    kernels_spent = busy if walls else kernels  # what the kernels add to the step
    bound = sum(r["bound_us"] for r in rows)
    mb = sum(r["mb"] for r in rows)
    rows.append({"group": "kernels", "calls": sum(r["calls"] for r in rows), "us": kernels, "wall_us": busy,
                 "mb": mb, "tbs": mb / kernels_spent if kernels_spent > 0 else None, "bound_us": bound,
                 "over_us": kernels_spent - bound})
    idle = (prof.get("span_us", 0.0) - prof.get("busy_us", 0.0)) / steps
    rows.append({"group": "idle, profiled", "calls": None, "us": idle, "wall_us": None, "mb": 0.0, "tbs": None,
                 "bound_us": 0.0, "over_us": idle})
    if "short_gaps_us" in prof:  # e2e.kernel_timeline's split (runs since session 39)
        short = prof["short_gaps_us"] / steps
        for group, us, calls in ((IDLE_BOUNDARIES, short, prof.get("short_gaps", 0) / steps),
                                 (IDLE_HOST, idle - short, None)):
            rows.append({"group": group, "calls": calls, "us": us, "wall_us": None, "mb": 0.0, "tbs": None,
                         "bound_us": 0.0, "over_us": us})
    ms = record["impls"][impl]["ms"]
    rows.append({"group": "step (timed)", "calls": None, "us": ms * 1e3, "wall_us": None,
                 "mb": record["bytes_per_step"] / 1e6,
                 "tbs": record["bytes_per_step"] / (ms * 1e9), "bound_us": record["bound_ms"] * 1e3,
                 "over_us": ms * 1e3 - record["bound_ms"] * 1e3})
    rows.append({"group": TIMED_NOT_KERNELS, "calls": None, "us": ms * 1e3 - kernels_spent, "wall_us": None,
                 "mb": 0.0, "tbs": None, "bound_us": 0.0, "over_us": ms * 1e3 - kernels_spent})
    return rows


def format_breakdown(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    walls = any(r.get("wall_us") is not None for r in rows)
    head = ["group", "calls/step", "µs/step"] + (["µs wall"] if walls else []) + \
        ["MB/step", "TB/s", "µs at peak", "µs over"]
    out = [head]
    for r in rows:
        none = r["calls"] == 0 and not r["us"]  # no kernel of the group (a peer's step): bytes only
        wall = [] if not walls else ["" if none or r.get("wall_us") is None else f"{r['wall_us']:.1f}"]
        out.append([r["group"], "" if r["calls"] is None else f"{r['calls']:.0f}", "" if none else f"{r['us']:.1f}"]
                   + wall + [f"{r['mb']:.1f}" if r["mb"] else "", f"{r['tbs']:.2f}" if r["tbs"] else "",
                             f"{r['bound_us']:.1f}" if r["bound_us"] else "", "" if none else f"{r['over_us']:.1f}"])
    return align_rows(out)


def main(argv: list[str] | None = None) -> int:
    """Print each profiled decode case's breakdown; 1 when the files have none."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench breakdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="bench e2e JSON files")
    ap.add_argument("--impl", default="ours", help="the implementation whose profile to read")
    ap.add_argument("--hbm", type=float, default=None,
                    help="HBM bytes/s of the bound (default: the run's own --hbm, else the H200's)")
    args = ap.parse_args(argv)
    shown = 0
    for path in args.files:
        doc = json.loads(path.read_text())
        if doc.get("suite") != "e2e":
            print(f"{path}: not a bench e2e result (suite {doc.get('suite')!r})", file=sys.stderr)
            continue
        for rec in doc["results"]:
            if rec.get("phase") != "decode":
                continue
            rows = step_breakdown(doc, rec, args.impl, args.hbm)
            if rows is None:
                continue
            shown += 1
            frac = rec["impls"][args.impl].get("frac_of_bound")
            print(f"\n{path.name}: {rec['model']} {rec['weights']} B={rec['batch']} ctx={rec['ctx']} {args.impl} "
                  f"(commit {doc.get('commit', '?')}" + (f"; {frac:.2f} of the bound)" if frac else ")"))
            print(format_breakdown(rows))
    if not shown:
        print(f"no profiled decode case of {args.impl!r} in {[str(f) for f in args.files]} "
              "(bench e2e --profile first|all writes one)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
