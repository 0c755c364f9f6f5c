"""Issue 12's whole-model targets against `bench e2e` JSON files: each case met or missed.

    python -m jax_onnx_attn.bench targets bench/results/FILE.json [...] [--impl ours] [--markdown]
    python -m jax_onnx_attn.bench targets --latest [bench/results] [--gpu H200]   # each case's latest run

The targets (measured on the H200; a file from another GPU is checked but flagged):
- decode, fp16, B=1, ctx 1k-8k: >= 0.80 of the bandwidth bound and >= 1.3x the JAX peer's speed;
- decode, int4, B=1, ctx 1k-8k: >= 0.60 of its own bound (packed bytes and scales);
- decode, fp16, B=8: >= 0.75 of the bound; B=32: >= 0.70;
- every profiled decode case: <= 10 kernels a decoder layer a step (a step's kernels over its
  layers, so the LM head's and the sampler's count too);
- prefill, the ~8B model, 2k-8k tokens: >= 0.60 of the GEMM peak measured in the same run, and a
  time to first token no slower than the JAX peer's.
A case no rule covers is not listed. The exit status is 0 when every listed case meets its target,
1 when one misses, 2 when the files hold no case a target covers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jax_onnx_attn.bench.decode import align_rows


@dataclass(frozen=True)
class Target:
    """One of issue 12's targets: the cases it covers, the figure it reads and its limit (a least
    value, or a most one where at_most)."""
    name: str
    covers: Callable[[dict], bool]  # a result record (bench e2e's results[])
    figure: Callable[[dict, dict, str], float | None]  # (doc, record, impl) -> the measured value
    limit: float
    unit: str
    at_most: bool = False
    # A case without the figure: a miss, or not listed (kernel counts exist only where profiled).
    missing_is_miss: bool = True

    def met(self, value: float | None) -> bool:
        """Whether a measured value meets the target (a missing one does not)."""
        return value is not None and (value <= self.limit if self.at_most else value >= self.limit)


def _ctx_1k_8k(r: dict) -> bool:
    return 1024 <= r["ctx"] <= 8192


def _frac(doc: dict, r: dict, impl: str) -> float | None:
    return r["impls"].get(impl, {}).get("frac_of_bound")


def _over_peer(doc: dict, r: dict, impl: str) -> float | None:
    """How many times faster `impl` is than the JAX peer in the same run (peer ms / impl ms)."""
    ours, peer = r["impls"].get(impl, {}).get("ms"), r["impls"].get("jax-peer", {}).get("ms")
    return peer / ours if ours and peer else None


def _kernels_a_layer(doc: dict, r: dict, impl: str) -> float | None:
    k = r["impls"].get(impl, {}).get("kernels_per_step")
    model = doc.get("models", {}).get(f"{r.get('model_alias')}/{r.get('weights')}")
    return k / model["config"]["layers"] if k and model else None


def _gemm_frac(doc: dict, r: dict, impl: str) -> float | None:
    return r["impls"].get(impl, {}).get("frac_of_gemm_peak")


def _decode(weights: str | None = None, batch: int | None = None, b1_ctx: bool = False):
    def covers(r: dict) -> bool:
        return (r["phase"] == "decode" and (weights is None or r["weights"] == weights)
                and (batch is None or r["batch"] == batch) and (not b1_ctx or _ctx_1k_8k(r)))
    return covers


def _prefill_8b(r: dict) -> bool:
    return r["phase"] == "prefill" and r.get("model_alias") == "8b" and 2048 <= r.get("tokens", r["ctx"]) <= 8192


#: Issue 12's targets, in its order; the single source the command and its tests read.
TARGETS = (
    Target("decode fp16 B=1 1k-8k: fraction of the bound", _decode("fp16", 1, True), _frac, 0.80, "of bound"),
    Target("decode fp16 B=1 1k-8k: speed over the JAX peer", _decode("fp16", 1, True), _over_peer, 1.3, "x peer"),
    Target("decode int4 B=1 1k-8k: fraction of the bound", _decode("int4", 1, True), _frac, 0.60, "of bound"),
    Target("decode fp16 B=8: fraction of the bound", _decode("fp16", 8), _frac, 0.75, "of bound"),
    Target("decode fp16 B=32: fraction of the bound", _decode("fp16", 32), _frac, 0.70, "of bound"),
    Target("decode: kernels a layer a step (at most 10)", _decode(), _kernels_a_layer, 10, "kernels",
           at_most=True, missing_is_miss=False),
    Target("prefill ~8B 2k-8k: fraction of the GEMM peak", _prefill_8b, _gemm_frac, 0.60, "of peak"),
    Target("prefill ~8B 2k-8k: TTFT over the JAX peer", _prefill_8b, _over_peer, 1.0, "x peer"),
)


def check(doc: dict, impl: str = "ours", records: list[dict] | None = None) -> list[dict]:
    """Rows {target, model, weights, batch, ctx, value, limit, at_most, unit, met} for each (target, case) of `doc`
    (a bench e2e JSON; `records`: only those of its results) the target covers and `impl` measured;
    value None (and met False) where the figure is missing (a case not profiled has no kernel
    count: left out instead)."""
    rows = []
    for t in TARGETS:
        for r in doc.get("results", []) if records is None else records:
            if impl not in r.get("impls", {}) or not t.covers(r):
                continue
            value = t.figure(doc, r, impl)
            if value is None and not t.missing_is_miss:
                continue
            rows.append({"target": t.name, "model": r["model"], "weights": r["weights"], "batch": r["batch"],
                         "ctx": r.get("tokens", r["ctx"]) if r["phase"] == "prefill" else r["ctx"],
                         "value": value, "limit": t.limit, "at_most": t.at_most, "unit": t.unit,
                         "met": t.met(value)})
    return rows


def _gpu(doc: dict) -> str:
    """The name of the GPU a bench e2e run measured on ("" when it says none)."""
    from jax_onnx_attn.bench.plots import gpu_name

    return str(gpu_name(doc.get("env") or {}) or gpu_name({"gpu": doc.get("gpu")}) or "")


def latest_runs(results_dir: str | Path, impl: str = "ours", gpu: str = "H200") -> list[tuple[Path, dict, list[dict]]]:
    """(path, doc, its records) such that each case (model, weights, batch, ctx, phase) measured on a
    `gpu` by `impl` appears once, from the latest run that measured it (the e2e figure's order:
    `plots._ordered_docs`); files in the order they ran."""
    from jax_onnx_attn.bench.plots import E2E_KEY_FIELDS, _ordered_docs

    case_fields = [f for f in E2E_KEY_FIELDS if f != "gpu"]  # the figure's case identity, one GPU here
    latest: dict[tuple, tuple[int, Path, dict, dict]] = {}
    for i, (path, doc) in enumerate(_ordered_docs(Path(results_dir))):
        if not isinstance(doc, dict) or doc.get("suite") != "e2e":
            continue
        if gpu not in _gpu(doc):
            continue
        for r in doc.get("results", []):
            if "ms" in r.get("impls", {}).get(impl, {}):
                latest[tuple(r[f] for f in case_fields)] = (i, path, doc, r)
    by_file: dict[int, tuple[Path, dict, list[dict]]] = {}
    for i, path, doc, r in sorted(latest.values(), key=lambda v: v[0]):
        by_file.setdefault(i, (path, doc, []))[2].append(r)
    return list(by_file.values())


def format_rows(rows: list[dict], markdown: bool = False) -> str:
    """The rows as an aligned table (or a markdown one)."""
    head = ["target", "model", "weights", "B", "ctx / tokens", "measured", "target", "met"]
    body = [[r["target"], r["model"], r["weights"], str(r["batch"]), str(r["ctx"]),
             "n/a" if r["value"] is None else f"{r['value']:.3f}",  # 3 places: 0.798 is not 0.80
             ("<= " if r["at_most"] else ">= ") + f"{r['limit']:g} {r['unit']}",
             "yes" if r["met"] else "**no**" if markdown else "NO"] for r in rows]
    if markdown:
        return "\n".join("| " + " | ".join(line) + " |" for line in [head, ["---"] * len(head)] + body)
    return align_rows([head] + body)


def main(argv: list[str] | None = None) -> int:
    """Print each file's rows and a count; 0 all met, 1 any missed, 2 nothing covered."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench targets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="bench e2e JSON files")
    ap.add_argument("--latest", nargs="?", const=Path("bench/results"), type=Path, metavar="DIR",
                    help="instead of files: each case's latest run on --gpu in DIR (default bench/results)")
    ap.add_argument("--gpu", default="H200", help="with --latest: runs on GPUs whose name holds this (default H200)")
    ap.add_argument("--impl", default="ours", help="the implementation held to the targets")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (for notes and docs)")
    args = ap.parse_args(argv)
    if bool(args.files) == bool(args.latest):
        ap.error("name bench e2e JSON files or --latest [DIR], not both")
    if args.latest:
        runs = latest_runs(args.latest, args.impl, args.gpu)
    else:
        runs = [(path, json.loads(path.read_text()), None) for path in args.files]
    met = listed = 0
    for path, doc, records in runs:
        if doc.get("suite") != "e2e":
            print(f"{path}: not a bench e2e result (suite {doc.get('suite')!r})", file=sys.stderr)
            continue
        rows = check(doc, args.impl, records)
        if not rows:
            continue
        flag = "" if "H200" in _gpu(doc) else " (not an H200: the targets are the H200's)"
        print(f"\n{path.name} (commit {doc.get('commit', '?')}){flag}")
        print(format_rows(rows, args.markdown))
        listed += len(rows)
        met += sum(r["met"] for r in rows)
    if not listed:
        print(f"no case of {[str(f) for f in args.files] or str(args.latest)} is covered by a target",
              file=sys.stderr)
        return 2
    print(f"\n{met} of {listed} met")
    return 0 if met == listed else 1


if __name__ == "__main__":
    sys.exit(main())
