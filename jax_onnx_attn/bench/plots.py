"""Figures from the benchmark JSON under bench/results/: speed against the peers and the roofline.

Used by notebooks/04_performance.ipynb and by `python tools/plot_bench.py`, which regenerates
docs/images/*.png from the committed JSON; `python -m jax_onnx_attn.bench.plots prefill FILE.json ...
--out PNG` draws the prefill figure of chosen runs. matplotlib is imported lazily (the `notebooks`
extra).

Input: every `*.json` in the results folder, each one run of `python -m jax_onnx_attn.bench <suite>
--out FILE` (the harness's schema):

    {"suite": "decode",                                  # "prefill" suites are read the same way
     "env": {"gpu": "<nvidia-smi CSV: header line, then name, driver, clocks, ...>", "commit": ...},
     "results": [{"batch": 8, "ctx": 8192, "q_len": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                  "dtype": "bf16",                       # bf16 | fp16 | fp32
                  "impls": {"ours": {"us": 20.1, "gbs": 3338.0},       # per-call time (µs)
                            "jax-xla": {"skip": "error: ..."}, ...}}, ...]}

Each measured impl of each case becomes one flat record (`load_results`; impls named as today, see
IMPL_ALIASES): impl, phase, dtype (numpy name), batch, q_heads, kv_heads, head_dim, q_len, kv_len,
causal, kv_bits, ragged (prefill rows of different lengths), time_s, tflops, gbps, intensity, gpu
(the GPU's name), source (file name). Skipped impls are left out. Numbers only count measured side
by side in one run, so a case (KEY_FIELDS less impl) takes all its records from one file: the latest
(`_run_order`: by date, run time, commit time, name) that measured ours at it, else the latest that
measured it at all; a peer measured only
in an older run of that case is left out rather than set against a newer ours.
Metrics, as DESIGN.md defines them:

- TFLOP/s = 4·B·Hq·S·T·D / time (QKᵀ and PV), halved for causal prefill with S == T; where the
  harness gives a case's "flops" (ragged rows, chunked prefill: the visible pairs) that count;
- effective GB/s = K + V bytes read / time = 2·B·Hkv·T·D·itemsize / time (the harness's "gbs" when
  it gives one);
- arithmetic intensity (roofline x) = FLOPs / (Q + K + V + output bytes).

Whole models (`python -m jax_onnx_attn.bench e2e`, "suite": "e2e") are read apart by `load_e2e`:
per case (model, weights, B, T, phase) and impl (ours, jax-peer, torch-peer) the harness's ms,
tokens/s and fraction of the bound (decode: `jax_onnx_attn.runtime.roofline`'s bandwidth bound;
prefill: the GEMM peak measured in the run), drawn by `plot_e2e` (docs/images/e2e_decode.png).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from jax_onnx_attn.runtime import roofline as _roofline

#: The folder of the committed benchmark JSON and of the regenerated figures, from the repo root.
RESULTS_DIR = Path("bench/results")
IMAGES_DIR = Path("docs/images")

#: What identifies one measurement; without "impl", one case (whose records come from one run).
KEY_FIELDS = ("impl", "phase", "dtype", "batch", "q_heads", "kv_heads", "head_dim", "q_len", "kv_len",
              "causal", "kv_bits", "ragged", "gpu")
#: Fields every result of the harness carries.
REQUIRED = ("batch", "ctx", "q_len", "q_heads", "kv_heads", "head_dim", "dtype", "impls")
#: Our own kernels' name in "impls"; every other impl is a peer.
OURS = "ours"
#: Results files whose impl names mean something else today: file name -> {name in the file: name
#: read}. The prefill bench's "ours" was the engine's serial schedule until 2026-12-02, when it became
#: the default schedule; in this run the default was already pingpong ("ours-pingpong").
IMPL_ALIASES = {"2026-12-01-4fae144-prefill.json": {"ours": "ours-serial", "ours-pingpong": "ours"},
                # measured when the default was pingpong; pingpong-fold-lazy is the D 128 default now
                "2026-12-02-3edaea0-prefill-tuned.json": {"ours": "ours-pingpong",
                                                          "ours-pingpong-fold-lazy": "ours"}}

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "float32": "float32"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Roofline limits of one GPU: HBM bandwidth (GB/s) and dense peak TFLOP/s per dtype."""

    name: str
    hbm_gbps: float
    peak_tflops: dict

    def peak(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for a numpy dtype name ("bfloat16", ...), or None when unknown."""
        return self.peak_tflops.get(dtype)


#: NVIDIA H200 SXM: 4.8 TB/s HBM3e; ~989 TFLOP/s dense bf16/fp16 tensor core; 67 TFLOP/s fp32 (CUDA
#: cores): the numbers of jax_onnx_attn.runtime.roofline (the one definition of the bound).
H200 = Hardware("NVIDIA H200", _roofline.H200_HBM_BYTES_PER_S / 1e9,
                {k: v / 1e12 for k, v in _roofline.H200_PEAK_FLOPS.items()})
HARDWARE = {"H200": H200}


class NoResults(FileNotFoundError):
    """No usable benchmark JSON; the message says what is missing and how to make it."""


# --------------------------------------------------------------------------------------------------
# Loading

def hardware_for(gpu: str | None) -> Hardware | None:
    """The Hardware whose key occurs in the GPU name (e.g. "NVIDIA H200"), or None."""
    for key, hw in HARDWARE.items():
        if gpu and key.lower() in gpu.lower():
            return hw
    return None


def gpu_name(env: dict) -> str | None:
    """The GPU's name from a run's env: its "gpu" field is nvidia-smi's CSV (header, then one line
    per GPU starting with the name) or a plain name."""
    text = (env or {}).get("gpu")
    if not text:
        return None
    lines = [line for line in str(text).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].lower().startswith("name"):
        return lines[1].split(",")[0].strip()
    return lines[0].split(",")[0].strip()


def flops(r: dict) -> float:
    """FLOPs of one attention call: 4·B·Hq·S·T·D, halved for causal prefill with S == T."""
    f = 4.0 * r["batch"] * r["q_heads"] * r["q_len"] * r["kv_len"] * r["head_dim"]
    if r.get("causal") and r["q_len"] == r["kv_len"]:
        f /= 2
    return f


def kv_bytes(r: dict) -> float:
    """Bytes of K and V read once: 2·B·Hkv·T·D·itemsize."""
    return 2.0 * r["batch"] * r["kv_heads"] * r["kv_len"] * r["head_dim"] * _ITEMSIZE[r["dtype"]]


def io_bytes(r: dict) -> float:
    """Minimum HBM traffic: Q and the output (B·Hq·S·D each) plus K and V."""
    return kv_bytes(r) + 2.0 * r["batch"] * r["q_heads"] * r["q_len"] * r["head_dim"] * _ITEMSIZE[r["dtype"]]


def _records(case: dict, suite: str | None, gpu: str | None, source: str) -> list[dict]:
    """The flat records of one harness result (one per impl that was measured)."""
    missing = [f for f in REQUIRED if f not in case]
    if missing:
        raise ValueError(f"{source}: a result lacks {missing}: {case}")
    dtype = _DTYPES.get(str(case["dtype"]))
    if dtype is None:
        raise ValueError(f"{source}: unknown dtype {case['dtype']!r} (known: {sorted(_DTYPES)})")
    base = {f: case[f] for f in ("batch", "q_len", "q_heads", "kv_heads", "head_dim")}
    base.update(dtype=dtype, kv_len=case["ctx"], gpu=gpu, source=source)
    base["phase"] = suite if suite in ("prefill", "decode") else (
        "prefill" if case["q_len"] == case["ctx"] else "decode")
    # The decode suite runs bottom-right causal; a prefill suite says so per case (default causal).
    base["causal"] = bool(case.get("causal", True))
    base["kv_bits"] = int(case.get("kv_bits", 0))  # 8 / 4: an int8 / int4 cache (ours only)
    # Prefill with right-padded rows of different lengths (its "flops" count the real lengths).
    base["ragged"] = case.get("kind") == "ragged"
    out = []
    for impl, m in case["impls"].items():
        if "us" not in m:
            continue  # {"skip": why}: not measured
        r = {**base, "impl": IMPL_ALIASES.get(source, {}).get(impl, impl), "time_s": m["us"] * 1e-6}
        work = case.get("flops") or flops(r)  # the harness's count (ragged, chunked) when it gives one
        r["tflops"] = m.get("tflops", work / r["time_s"] / 1e12)
        r["gbps"] = m.get("gbs", kv_bytes(r) / r["time_s"] / 1e9)
        r["intensity"] = work / io_bytes(r)
        out.append(r)
    return out


#: Suites whose results are single kernels (a file without "suite" counts as one).
KERNEL_SUITES = (None, "decode", "prefill")
#: The impl that plays "ours" in the gqa suite (whole GroupQueryAttention steps, `bench gqa`).
STEP_OURS = "cuda"


def load_results(results_dir: str | Path = RESULTS_DIR, suites: Sequence[str | None] = KERNEL_SUITES,
                 ours: str = OURS) -> list[dict]:
    """Every measurement of `suites` in `results_dir/*.json` as flat records, each case's from one
    run (the latest with `ours`, in the order the runs were measured: `_run_order`; see the module
    docstring). Raises NoResults when the folder holds no JSON with such measurements.
    `suites=("gqa",), ours=STEP_OURS` reads the whole-step suite."""
    results_dir = Path(results_dir)
    docs = _ordered_docs(results_dir)
    latest = _latest_records(docs, suites, ours)
    if not latest:
        where = f"{results_dir}/ has no *.json" if not docs else \
            f"the {len(docs)} JSON file(s) in {results_dir}/ hold no measurements"
        raise NoResults(
            f"no benchmark results to plot: {where}. Measure on the GPU machine with "
            f"`python -m jax_onnx_attn.bench {next((x for x in suites if x), 'decode')} "
            f"--out {RESULTS_DIR}/<name>.json`, "
            f"commit the JSON, then run `python tools/plot_bench.py`.")
    return latest


def load_files(files: Sequence[str | Path], suites: Sequence[str | None] = KERNEL_SUITES,
               ours: str = OURS) -> list[dict]:
    """`load_results` on the given JSON files (in that order: a later file's run of a case replaces
    an earlier one's); [] when they hold no measurements of `suites`."""
    return _latest_records([(Path(f), json.loads(Path(f).read_text())) for f in files], suites, ours)


def _latest_records(docs: Sequence[tuple[Path, object]], suites: Sequence[str | None], ours: str) -> list[dict]:
    """The records of `suites` in (path, doc) pairs, oldest first, each case's from its latest run."""
    case_fields = [f for f in KEY_FIELDS if f != "impl"]
    runs: dict[tuple, list[list[dict]]] = {}  # case -> its runs' records, oldest file first
    for path, doc in docs:
        if not isinstance(doc, dict) or doc.get("suite") not in suites:  # e.g. a probe's bare list
            continue
        gpu = gpu_name(doc.get("env", {}))
        for case in doc.get("results", []):
            recs = _records(case, doc.get("suite"), gpu, path.name)
            if recs:
                runs.setdefault(tuple(recs[0].get(f) for f in case_fields), []).append(recs)
    latest = []
    for case_runs in runs.values():
        with_ours = [recs for recs in case_runs if any(r["impl"] == ours for r in recs)]
        latest.extend((with_ours or case_runs)[-1])
    return latest


def main_gpu(records: Sequence[dict]) -> str | None:
    """The GPU most records were measured on (figures show one GPU at a time)."""
    counts = Counter(r.get("gpu") for r in records)
    return counts.most_common(1)[0][0] if counts else None


def select(records: Iterable[dict], **where) -> list[dict]:
    """Records whose fields equal every keyword given (None values are ignored)."""
    return [r for r in records if all(v is None or r.get(k) == v for k, v in where.items())]


# --------------------------------------------------------------------------------------------------
# Figures

def _plt():
    import matplotlib
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    return matplotlib, plt


#: Peers in a fixed colour order, so one peer has one colour in every panel.
PEERS = ("jax-xla", "jax-cudnn", "torch-flash", "torch-cudnn", "reference", "jax-mosaic")


def _style(impls: Iterable[str]) -> dict:
    """impl -> matplotlib kwargs: ours bold black, each peer its own colour of the cycle."""
    _, plt = _plt()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    others = sorted(i for i in impls if i != OURS and i not in PEERS)
    style = {}
    for impl in sorted(impls, key=lambda s: (s != OURS, s)):
        if impl == OURS:
            style[impl] = dict(color="black", lw=2.2, marker="o", zorder=5)
        else:
            index = PEERS.index(impl) if impl in PEERS else len(PEERS) + others.index(impl)
            style[impl] = dict(color=colors[index % len(colors)], lw=1.3, marker="s", ms=4)
    return style


#: The fields a figure holds fixed: one line per impl needs the same problem on the x axis.
SHAPE_FIELDS = ("dtype", "q_heads", "kv_heads", "head_dim", "causal")
_METRIC = {"prefill": ("tflops", "TFLOP/s"), "decode": ("gbps", "effective GB/s (K+V read)")}


def problem(records: Sequence[dict], phase: str) -> dict:
    """The `select` filter (besides the phase) of one figure: the phase's most measured
    SHAPE_FIELDS and, for decode, the smallest query length measured (1 = plain decode)."""
    recs = select(records, phase=phase)
    if not recs:
        return {}
    counts = Counter(tuple(r.get(f) for f in SHAPE_FIELDS) for r in recs)
    where = dict(zip(SHAPE_FIELDS, counts.most_common(1)[0][0]))
    if phase == "decode":
        where["q_len"] = min(r["q_len"] for r in select(recs, **where))
    return where


def _title(phase: str, where: dict) -> str:
    text = f"{phase}: {where.get('dtype')}, Hq={where.get('q_heads')}/Hkv={where.get('kv_heads')}, " \
           f"D={where.get('head_dim')}"
    if phase == "decode":
        text += f", S={where.get('q_len')}"
    elif where.get("causal"):
        text += ", causal"
    return text


def plot_vs_context(records: Sequence[dict], phase: str, ax=None, hardware: Hardware | None = None,
                    batch: int | None = None, **where):
    """TFLOP/s (prefill) or effective GB/s (decode) against the context length T, one line per impl
    (per impl and batch when `batch` is None and several were measured), with the hardware limit
    drawn in (peak TFLOP/s or HBM bandwidth). `where` narrows the records (default: `problem`)."""
    _, plt = _plt()
    where = {**problem(records, phase), **where}
    recs = select(records, phase=phase, batch=batch, **where)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    metric, unit = _METRIC[phase]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length T (keys)")
    ax.set_ylabel(unit)
    ax.set_title(_title(phase, where) + (f", B={batch}" if batch else ""), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    if hardware is not None:
        limit = hardware.hbm_gbps if phase == "decode" else hardware.peak(where.get("dtype"))
        if limit:
            what = "HBM bandwidth" if phase == "decode" else f"dense {where.get('dtype')} peak"
            ax.axhline(limit, color="crimson", ls="--", lw=1)
            ax.text(0.01, limit, f" {hardware.name} {what}: {limit:g}", color="crimson", fontsize=7,
                    va="bottom", transform=ax.get_yaxis_transform())
            ax.set_ylim(0, limit * 1.12)
    if not recs:
        ax.text(0.5, 0.5, f"no {phase} results", ha="center", va="center", transform=ax.transAxes)
        return ax
    batches = _draw_series(ax, recs, "impl", metric, "{}")
    ax.legend(fontsize=7, ncol=2 if batches > 1 else 1)
    return ax


def _draw_series(ax, rows: Sequence[dict], series: str, metric: str, label: str) -> int:
    """One line per (rows[series], batch) of `metric` against kv_len, colour per series and dash per
    batch; `label` formats the series name. Returns the number of batch sizes drawn."""
    style = _style({r[series] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    dashes = ["-", "--", ":", "-."]
    for name in style:
        for bi, b in enumerate(batches):
            pts = sorted((r for r in rows if r[series] == name and r["batch"] == b),
                         key=lambda r: r["kv_len"])
            if pts:
                text = label.format(name) + ("" if len(batches) == 1 else f", B={b}")
                ax.plot([r["kv_len"] for r in pts], [r[metric] for r in pts], ls=dashes[bi % 4],
                        label=text, **style[name])
    return len(batches)


def ratio_table(records: Sequence[dict], ours: str = OURS) -> list[dict]:
    """Per configuration measured for `ours` and a peer: {config fields..., "peer", "ratio"} with
    ratio = our metric / the peer's (TFLOP/s for prefill, GB/s for decode; > 1: we are faster)."""
    shape = [f for f in KEY_FIELDS if f != "impl"]
    peers: dict[tuple, list[dict]] = {}
    for p in records:
        if p["impl"] != ours:
            peers.setdefault(tuple(p.get(f) for f in shape), []).append(p)
    rows = []
    for r in select(records, impl=ours):
        metric = _METRIC[r["phase"]][0]
        for p in peers.get(tuple(r.get(f) for f in shape), []):
            rows.append({**{f: r.get(f) for f in shape}, "peer": p["impl"], "ratio": r[metric] / p[metric]})
    return rows


def plot_ratio_vs_context(records: Sequence[dict], phase: str, ax=None, batch: int | None = None,
                          ours: str = OURS, **where):
    """Our metric over each peer's against the context length (1 = parity, above: we are faster)."""
    matplotlib, plt = _plt()
    where = {**problem(records, phase), **where}
    rows = ratio_table(select(records, phase=phase, batch=batch, **where), ours)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    times = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×")
    ax.yaxis.set_major_formatter(times)
    ax.yaxis.set_minor_formatter(times)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xlabel("context length T (keys)")
    ax.set_ylabel(f"{ours} / peer")
    ax.grid(True, which="both", alpha=0.3)
    if not rows:
        ax.text(0.5, 0.5, f"no configuration measured for both {ours!r} and a peer", ha="center",
                va="center", transform=ax.transAxes, fontsize=8)
        return ax
    _draw_series(ax, rows, "peer", "ratio", "vs {}")
    ax.legend(fontsize=7)
    return ax


def plot_phase(records: Sequence[dict], phase: str, hardware: Hardware | None = None, **where):
    """One figure for a phase: a column per batch size, the metric on top and our ratio to each
    peer below (when our kernels were measured). Returns the Figure."""
    _, plt = _plt()
    where = {**problem(records, phase), **where}
    recs = select(records, phase=phase, **where)
    batches = sorted({r["batch"] for r in recs}) or [None]
    with_ratio = bool(ratio_table(recs))
    rows = 2 if with_ratio else 1
    fig, axes = plt.subplots(rows, len(batches), figsize=(4.2 * len(batches), 3.4 * rows),
                             squeeze=False, layout="constrained")
    for col, b in enumerate(batches):
        plot_vs_context(recs, phase, axes[0, col], hardware, batch=b, **where)
        if with_ratio:
            plot_ratio_vs_context(recs, phase, axes[1, col], batch=b, **where)
    return fig


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _prefill_extra_label(r: dict) -> str:
    mask = "causal" if r["causal"] else "non-causal"
    if r["ragged"]:
        return f"ragged B={r['batch']} S={_tokens_label(r['q_len'])}\n{mask}"
    return f"chunk {_tokens_label(r['q_len'])} on T={_tokens_label(r['kv_len'])}, B={r['batch']}\n{mask}"


def plot_prefill(records: Sequence[dict], hardware: Hardware | None = None, **where):
    """The prefill figure: TFLOP/s against the prompt length S (self-attention, every row full, B·S
    held constant by the harness), one line per impl, a causal and a non-causal panel; when the
    records hold ragged or chunked-prefill cases of the same problem, a third panel of bars for
    them. `where` narrows the records (default: the most measured dtype / heads / head size).
    Returns the Figure."""
    _, plt = _plt()
    recs = select(records, phase="prefill")
    if recs and not where:
        counts = Counter((r["dtype"], r["q_heads"], r["kv_heads"], r["head_dim"]) for r in recs)
        where = dict(zip(("dtype", "q_heads", "kv_heads", "head_dim"), counts.most_common(1)[0][0]))
    recs = select(recs, **where)
    full = [r for r in recs if r["q_len"] == r["kv_len"] and not r["ragged"]]
    extra = [r for r in recs if r not in full]
    panels = 3 if extra else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8), squeeze=False, layout="constrained")
    axes = axes[0]
    style = _style({r["impl"] for r in recs})
    # The engine's other schedules ("ours-overlap", ...): grey, dashed, beside ours in black.
    for n, impl in enumerate(sorted(i for i in style if i.startswith(OURS + "-"))):
        style[impl] = dict(color=("0.45", "0.65", "0.3")[n % 3], lw=1.2, ls=("--", ":", "-.")[n % 3],
                           marker="o", ms=3)
    limit = hardware.peak(where.get("dtype")) if hardware is not None else None
    tokens = sorted({r["batch"] * r["q_len"] for r in full})
    for ax, causal in zip(axes, (True, False)):
        rows = [r for r in full if r["causal"] == causal]
        ax.set_xscale("log", base=2)
        per_row = f"; B = {_tokens_label(tokens[0])} / S" if len(tokens) == 1 else ""
        ax.set_xlabel(f"prompt length S (= T){per_row}")
        ax.set_ylabel("TFLOP/s")
        ax.set_title("causal" if causal else "non-causal", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        if limit:
            ax.axhline(limit, color="crimson", ls="--", lw=1)
            ax.text(0.01, limit, f" {hardware.name} dense peak: {limit:g}", color="crimson", fontsize=7,
                    va="bottom", transform=ax.get_yaxis_transform())
            ax.set_ylim(0, limit * 1.12)
        if not rows:
            ax.text(0.5, 0.5, "no results", ha="center", va="center", transform=ax.transAxes)
            continue
        for impl in style:
            pts = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["q_len"])
            if pts:
                ax.plot([r["q_len"] for r in pts], [r["tflops"] for r in pts], label=impl, **style[impl])
        xs = sorted({r["q_len"] for r in rows})
        ax.set_xticks(xs, [_tokens_label(x) for x in xs])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    if extra:
        ax = axes[2]
        fields = ("ragged", "causal", "q_len", "kv_len", "batch")
        cases = sorted({tuple(r[f] for f in fields) for r in extra}, key=lambda c: (c[0], not c[1], c[2], c[3]))
        impls = [i for i in style if any(r["impl"] == i for r in extra)]
        width = 0.8 / max(len(impls), 1)
        labels, drawn = [], set()
        for x, case in enumerate(cases):
            for j, impl in enumerate(impls):
                r = [r for r in extra if r["impl"] == impl and tuple(r[f] for f in fields) == case]
                if r:
                    ax.bar(x + (j - (len(impls) - 1) / 2) * width, r[0]["tflops"], width,
                           color=style[impl]["color"], label=None if impl in drawn else impl)
                    drawn.add(impl)
            labels.append(_prefill_extra_label(dict(zip(fields, case))))
        ax.legend(fontsize=7)
        ax.set_xticks(range(len(cases)), labels, fontsize=7)
        ax.set_ylabel("TFLOP/s (real lengths / visible pairs)")
        ax.set_title("ragged rows, chunked prefill", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        if limit:
            ax.set_ylim(0, limit * 1.12)
    gpu = main_gpu(recs)
    fig.suptitle(f"prefill attention{' on ' + gpu if gpu else ''}: {where.get('dtype')}, "
                 f"Hq={where.get('q_heads')}/Hkv={where.get('kv_heads')}, D={where.get('head_dim')}",
                 fontsize=10)
    return fig


def plot_roofline(records: Sequence[dict], ax=None, hardware: Hardware | None = H200,
                  dtype: str = "bfloat16"):
    """Achieved TFLOP/s against arithmetic intensity (FLOP per byte of Q, K, V and output), under
    the roofline min(peak, intensity × HBM bandwidth). Prefill circles, decode triangles."""
    _, plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    recs = select(records, dtype=dtype)
    x_lo, x_hi = 0.5, 1e5
    if recs:
        xs = [r["intensity"] for r in recs]
        x_lo, x_hi = min(x_lo, min(xs) / 2), max(x_hi, max(xs) * 2)
    if hardware is not None and hardware.peak(dtype):
        peak, bw = hardware.peak(dtype), hardware.hbm_gbps / 1e3  # TB/s -> TFLOP/s per FLOP/B
        x = np.logspace(np.log10(x_lo), np.log10(x_hi), 200)
        ax.plot(x, np.minimum(peak, x * bw), color="crimson", lw=2,
                label=f"{hardware.name} roofline: {hardware.hbm_gbps / 1e3:g} TB/s, {peak:g} TFLOP/s")
        ax.axvline(peak / bw, color="crimson", ls=":", lw=1)
    style = _style({r["impl"] for r in recs})
    for impl in style:
        for phase, marker in (("prefill", "o"), ("decode", "^")):
            pts = select(recs, impl=impl, phase=phase)
            if pts:
                kw = {k: v for k, v in style[impl].items() if k in ("color", "zorder")}
                ax.scatter([r["intensity"] for r in pts], [r["tflops"] for r in pts], marker=marker,
                           s=40 if impl == OURS else 18, alpha=0.85, label=f"{impl} {phase}", **kw)
    if not recs:
        ax.text(0.5, 0.5, f"no {dtype} results yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(0.1, 2000)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of Q, K, V, O)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline, {dtype}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_step_speedup(records: Sequence[dict], ax=None, ours: str = STEP_OURS):
    """Whole-step speed-up (a peer's time / ours, e.g. the XLA reference over our kernels) per case of
    the gqa suite (`load_results(..., suites=("gqa",), ours=STEP_OURS)`), one bar per case and peer,
    quantised caches hatched; the 1x line marks parity."""
    _, plt = _plt()
    rows = sorted(ratio_table(records, ours), key=lambda r: (r["peer"], r["kv_bits"], r["batch"], r["kv_len"]))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.35 * max(len(rows), 4) + 1.2), layout="constrained")
    style = _style({r["peer"] for r in rows} | {ours})
    labels, seen = [], set()
    for y, r in enumerate(rows):
        cache = {0: r["dtype"], 8: "int8", 4: "int4"}.get(r["kv_bits"], f"int{r['kv_bits']}")
        labels.append(f"B={r['batch']} T={r['kv_len']} {cache}")
        ax.barh(y, r["ratio"], color=style[r["peer"]]["color"], hatch="//" if r["kv_bits"] else None,
                edgecolor="white", label=None if r["peer"] in seen else f"vs {r['peer']}")
        seen.add(r["peer"])
        ax.text(r["ratio"], y, f" {r['ratio']:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel(f"speed-up of {ours} (peer time / {ours} time)")
    where = rows[0] if rows else {}
    ax.set_title(f"GroupQueryAttention decode step: Hq={where.get('q_heads')}/Hkv={where.get('kv_heads')}, "
                 f"D={where.get('head_dim')}, S={where.get('q_len')}", fontsize=9)
    if rows:
        ax.legend(fontsize=7, loc="lower right")
    return ax


# --------------------------------------------------------------------------------------------------
# Whole models (the e2e suite)

#: What identifies one e2e case (records of a case come from one run).
E2E_KEY_FIELDS = ("model", "weights", "batch", "ctx", "phase", "gpu")
#: Impls of the e2e suite in drawing order.
E2E_IMPLS = ("ours", "jax-peer", "torch-peer")


def load_e2e(results_dir: str | Path = RESULTS_DIR) -> list[dict]:
    """The measurements of `python -m jax_onnx_attn.bench e2e` in `results_dir/*.json` as flat records:
    model, model_alias, weights, weight_bits, batch, ctx, phase, impl, ms, tokens_per_s, frac
    (frac_of_bound for decode, frac_of_gemm_peak for prefill), kernels_per_step, gpu, source. Each
    case's records come from one run: the latest that measured ours at it (`_run_order`). Raises
    NoResults when there are none."""
    results_dir = Path(results_dir)
    runs: dict[tuple, list[list[dict]]] = {}
    for path, doc in _ordered_docs(results_dir):
        if not isinstance(doc, dict) or doc.get("suite") != "e2e":
            continue
        gpu = gpu_name(doc.get("env", {}))
        for case in doc.get("results", []):
            recs = []
            for impl, m in case.get("impls", {}).items():
                if "ms" not in m:
                    continue
                recs.append({"model": case["model"], "model_alias": case.get("model_alias", case["model"]),
                             "weights": case["weights"], "weight_bits": case.get("weight_bits"),
                             "batch": case["batch"], "ctx": case["ctx"], "phase": case["phase"],
                             "impl": impl, "ms": m["ms"], "tokens_per_s": m["tokens_per_s"],
                             "frac": m.get("frac_of_bound", m.get("frac_of_gemm_peak")),
                             "kernels_per_step": m.get("kernels_per_step"), "gpu": gpu,
                             "source": path.name})
            if recs:
                key = tuple(recs[0][f] for f in E2E_KEY_FIELDS)
                runs.setdefault(key, []).append(recs)
    latest = []
    for case_runs in runs.values():
        with_ours = [recs for recs in case_runs if any(r["impl"] == OURS for r in recs)]
        latest.extend((with_ours or case_runs)[-1])
    if not latest:
        raise NoResults(f"no e2e results in {results_dir}/: measure on the GPU machine with "
                        "`python -m jax_onnx_attn.bench e2e --out bench/results/<date>-<commit>-e2e.json`")
    return latest


def _commit_times(where: Path) -> dict[str, int]:
    """{7-character commit hash: commit time} of the git checkout holding `where` ({} without one)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(where), "log", "--all", "--format=%H %ct"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    times = {}
    for line in out.splitlines():
        full, _, t = line.partition(" ")
        times.setdefault(full[:7], int(t))
    return times


def _ordered_docs(results_dir: Path) -> list[tuple[Path, object]]:
    """(path, parsed JSON) of every `results_dir/*.json`, in the order the runs were measured."""
    files = sorted(results_dir.glob("*.json")) if results_dir.is_dir() else []
    return _run_order([(path, json.loads(path.read_text())) for path in files], results_dir)


def _run_order(docs: list[tuple[Path, object]], where: Path) -> list[tuple[Path, object]]:
    """Result files in the order they were measured: by the date their name starts with, then by
    the time the run wrote (`measured`, since session 26), else by the time of the commit it
    measured (from git, where the results sit in a checkout: runs of one day named by commit hash
    would otherwise sort by the hashes' spelling), then by name."""
    times = _commit_times(where) if docs else {}

    def key(item):
        path, doc = item
        doc = doc if isinstance(doc, dict) else {}  # e.g. a probe's bare list
        commit = str(doc.get("commit") or doc.get("env", {}).get("commit") or "").split("+")[0][:7]
        date = path.name[:10] if re.match(r"\d{4}-\d{2}-\d{2}", path.name) else ""
        return (date, doc.get("measured") or "", times.get(commit, 0), path.name)

    return sorted(docs, key=key)


def _ctx_label(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def plot_e2e(records: Sequence[dict], phase: str = "decode", fig=None, variants: bool = False):
    """Whole-model speed per case, ours beside each peer: one panel per (model, weights), two per
    row, each with tokens/s on top (log scale) and the fraction of the bandwidth bound (decode) or
    of the measured GEMM peak (prefill) below, one group of bars per (B, T). `variants`: also the
    A/B forms of ours that some runs measured ("ours[...]"); left out by default so the figure
    stays readable. Returns the Figure."""
    _, plt = _plt()
    recs = [r for r in select(records, phase=phase) if variants or r["impl"] in E2E_IMPLS]
    cases = sorted({(r["model"], r["weights"], r["batch"], r["ctx"]) for r in recs})
    groups = sorted({(m, w) for m, w, _, _ in cases})
    impls = [i for i in E2E_IMPLS if any(r["impl"] == i for r in recs)] + \
        sorted({r["impl"] for r in recs} - set(E2E_IMPLS))
    ncols = 2 if len(groups) > 1 else 1
    nrows = max(1, -(-len(groups) // ncols))
    per_row = [sum(sum(1 for c in cases if c[:2] == g) for g in groups[i * ncols:(i + 1) * ncols])
               for i in range(nrows)]
    if fig is None:
        width = max(6.0, 0.3 * max(per_row or [0]) * max(len(impls), 1) + 2.5 * ncols)
        fig = plt.figure(figsize=(width, 4.2 * nrows), layout="constrained")
    if not cases:
        top = fig.subplots(2, 1, sharex=True)[0]
        top.text(0.5, 0.5, f"no e2e {phase} results yet", ha="center", va="center", transform=top.transAxes)
        return fig
    colors = {"ours": "black", "jax-peer": "tab:blue", "torch-peer": "tab:orange"}
    width = 0.8 / max(len(impls), 1)
    metric = "fraction of the bandwidth bound" if phase == "decode" else "fraction of the GEMM peak"
    panels = fig.subfigures(nrows, ncols, squeeze=False).ravel()
    for sub, (model, weights) in zip(panels, groups):
        own = [c for c in cases if c[:2] == (model, weights)]
        top, bottom = sub.subplots(2, 1, sharex=True)
        for j, impl in enumerate(impls):
            xs, tps, fr = [], [], []
            for x, case in enumerate(own):
                r = select(recs, impl=impl, model=model, weights=weights, batch=case[2], ctx=case[3])
                if r:
                    xs.append(x + (j - (len(impls) - 1) / 2) * width)
                    tps.append(r[0]["tokens_per_s"])
                    fr.append(r[0]["frac"] or 0.0)
            kw = dict(width=width, color=colors.get(impl, f"C{j + 3}"), label=impl)
            top.bar(xs, tps, **kw)
            bottom.bar(xs, fr, **kw)
        top.set_yscale("log")
        top.set_ylabel("tokens/s")
        bottom.set_ylabel(metric, fontsize=8)
        bottom.set_ylim(0, 1.05)
        bottom.axhline(1.0, color="crimson", lw=1, ls="--")
        bottom.set_xticks(range(len(own)), [f"B={b} T={_ctx_label(t)}" for _, _, b, t in own], fontsize=8)
        for ax in (top, bottom):
            ax.grid(True, axis="y", which="both", alpha=0.3)
        name = model.split("-")[-1] if model.startswith("llama") else model
        sub.suptitle(f"~{name.upper()} {weights} ({model})", fontsize=10)
    # Handles drawn here: a panel without an impl's bars would give its legend entry no color.
    from matplotlib.patches import Patch
    fig.axes[0].legend(handles=[Patch(color=colors.get(i, f"C{k + 3}"), label=i) for k, i in enumerate(impls)],
                       fontsize=8)
    gpu = main_gpu(recs)
    fig.suptitle(f"whole-model {phase}{' on ' + gpu if gpu else ''}: ours vs a hand-written JAX decoder "
                 "and torch on the same weights", fontsize=11)
    return fig


def regenerate(results_dir: str | Path = RESULTS_DIR, images_dir: str | Path = IMAGES_DIR) -> list[Path]:
    """Write every figure as PNG into `images_dir` from the JSON in `results_dir`; returns the paths.

    Figures (of the GPU with the most measurements): prefill_tflops.png (`plot_prefill`) and
    decode_gbps.png (`plot_phase`) for the phases measured, decode_gbps_s<S>.png for each longer
    query length of the decode problem, roofline.png, gqa_step.png when the gqa suite was measured
    there (`plot_step_speedup`), and e2e_decode.png when the e2e suite was (`plot_e2e`, whole models
    on their most measured GPU). Raises NoResults when there are no kernel results to plot.
    """
    _, plt = _plt()
    records = load_results(results_dir)
    gpu = main_gpu(records)
    records = [r for r in select(records, gpu=gpu) if not r["kv_bits"]]  # figures compare float caches
    hw = hardware_for(gpu)
    images_dir = Path(images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = images_dir / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    if select(records, phase="prefill"):
        save(plot_prefill(records, hw), "prefill_tflops.png")
    if select(records, phase="decode"):
        save(plot_phase(records, "decode", hw), "decode_gbps.png")
    # Decode with several query rows (speculative verify) on the same problem, one figure per S.
    where = problem(records, "decode")
    shape = {f: where[f] for f in SHAPE_FIELDS if f in where}
    for s in sorted({r["q_len"] for r in select(records, phase="decode", **shape)} - {where.get("q_len")}):
        save(plot_phase(records, "decode", hw, q_len=s), f"decode_gbps_s{s}.png")
    dtype = Counter(r["dtype"] for r in records).most_common(1)[0][0]
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    plot_roofline(records, ax, hw, dtype)
    save(fig, "roofline.png")
    try:
        steps = select(load_results(results_dir, ("gqa",), STEP_OURS), gpu=gpu)
    except NoResults:
        steps = []
    if ratio_table(steps, STEP_OURS):
        save(plot_step_speedup(steps).figure, "gqa_step.png")
    try:
        whole = load_e2e(results_dir)
    except NoResults:
        whole = []
    whole = select(whole, gpu=main_gpu(whole)) if whole else []
    if select(whole, phase="decode"):
        save(plot_e2e(whole, "decode"), "e2e_decode.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jax_onnx_attn.bench.plots prefill FILE.json ... [--out PNG]`: the prefill figure
    (`plot_prefill`) of the given runs (a later file's run of a case replaces an earlier one's), on
    their most measured GPU. Returns 0, or 1 when the files hold no prefill measurements."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench.plots",
                                 description="One figure from chosen benchmark JSON files (all of "
                                             "bench/results/: tools/plot_bench.py).")
    ap.add_argument("figure", choices=["prefill"])
    ap.add_argument("files", nargs="+", type=Path, help="bench JSON files (suite prefill)")
    ap.add_argument("--out", type=Path, default=IMAGES_DIR / "prefill_tflops.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    _, plt = _plt()
    records = load_files(args.files, ("prefill",))
    if not records:
        print(f"no prefill measurements in {[str(f) for f in args.files]}", file=sys.stderr)
        return 1
    gpu = main_gpu(records)
    fig = plot_prefill(select(records, gpu=gpu), hardware_for(gpu))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


__all__ = ["Hardware", "H200", "HARDWARE", "NoResults", "RESULTS_DIR", "IMAGES_DIR", "OURS",
           "KERNEL_SUITES", "STEP_OURS", "plot_step_speedup",
           "KEY_FIELDS", "SHAPE_FIELDS", "load_results", "select", "main_gpu", "gpu_name",
           "hardware_for", "problem", "flops", "kv_bytes", "io_bytes", "plot_vs_context",
           "ratio_table", "plot_ratio_vs_context", "plot_phase", "plot_roofline", "regenerate",
           "load_e2e", "plot_e2e", "E2E_KEY_FIELDS", "E2E_IMPLS", "load_files", "plot_prefill", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
