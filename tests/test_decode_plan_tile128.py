"""The decode planner's wide KV tile (plan.h kWideTileN, WideTile, MakePlan(..., tile128)) on the CPU.

plan.h is host-only C++: these tests compile it with the host compiler into a small program that
prints layouts and plans as JSON (no extension build needed, so they check this tree's header even
where the installed extension is another build's), then check the rules: where the wide tile applies
(16-row blocks of a float cache at head dims 64 / 128) its splits are whole 128-row tiles, its layout
fits the shared-memory budget with the stages the docs name, and every other call plans as without
it. The extension's export of the same plan is checked when the extension has it.
"""

import itertools
import json
import subprocess

import pytest

from host_plan import HEAD_DIMS, compile_program
from jax_onnx_attn import _extension

# (batch, q_heads, kv_heads, q_len, capacity) of the plans compared: decode steps of the decoders
# (32/8 and 16/4, q_len 1 and 4), a 64-row block (32/8 q_len 16), ragged capacities (not whole 64- or
# 128-row tiles), B 1 to 64.
SHAPES = [(b, hq, hkv, s, c)
          for b in (1, 2, 8, 32, 64)
          for hq, hkv, s in ((32, 8, 1), (32, 8, 4), (16, 4, 1), (6, 2, 5), (32, 8, 16))
          for c in (1, 100, 200, 1000, 2048, 2304, 4096, 8192, 16384)]

_PROGRAM = r"""
#include <cstdio>
#include "kernels/decode/plan.h"
using namespace joa;
using namespace joa::decode;

static void Layout1(int d, int tile_n) {
  const decode::Layout l = MakeLayout(d, 1, 4, 2, 0, false, false, tile_n);
  std::printf("{\"kind\":\"layout\",\"d\":%d,\"tile\":%d,\"tile_n\":%d,\"warp_n\":%d,\"chunk\":%d,"
              "\"stages\":%d,\"ctas_per_sm\":%d,\"smem\":%d,\"stage_bytes\":%d,\"cluster_combine\":%d}\n",
              d, tile_n, l.tile_n, l.warp_n, l.chunk, l.stages, l.ctas_per_sm, l.smem_bytes,
              l.stage_bytes, int(l.cluster_combine));
}

int main() {
  const int dims[] = {JOA_DECODE_HEAD_DIMS};
  for (int d : dims) {
    Layout1(d, 0);
    if (WideTile(16, d, KvFormat::kDense, true)) Layout1(d, kWideTileN);
  }
  long long b, hq, hkv, s, c;
  int d, bits, cap, cl, pol, wide;
  long long split;
  while (std::scanf("%lld %lld %lld %lld %lld %d %d %d %lld %d %d %d", &b, &hq, &hkv, &s, &c, &d, &bits,
                    &cap, &split, &cl, &pol, &wide) == 12) {
    const KvFormat f = bits == 8 ? KvFormat::kInt8 : bits == 4 ? KvFormat::kInt4 : KvFormat::kDense;
    const Plan p = MakePlan(b, hq, hkv, s, c, d, f, cap != 0, split, cl, PlanPolicy(pol), wide != 0);
    std::printf("{\"kind\":\"plan\",\"split_rows\":%lld,\"splits\":%lld,\"cluster\":%d,\"workspace_elems\":%lld,"
                "\"block_rows\":%d,\"ctas_per_sm\":%d,\"tile_rows\":%d}\n",
                (long long)p.split_rows, (long long)p.splits, int(p.cluster), (long long)p.workspace_elems,
                p.block_rows, p.ctas_per_sm, p.tile_rows);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    exe = compile_program(tmp_path_factory.mktemp("plan"), _PROGRAM)

    def run(queries=()):
        stdin = "".join(" ".join(str(int(x)) for x in q) + "\n" for q in queries)
        out = subprocess.run([str(exe)], input=stdin, check=True, capture_output=True, text=True).stdout
        rows = [json.loads(line) for line in out.splitlines()]
        return ([r for r in rows if r["kind"] == "layout"], [r for r in rows if r["kind"] == "plan"])

    return run


def _wide_applies(hq, hkv, s, d, bits):
    return bits == 0 and (hq // hkv) * s <= 16 and d in (64, 128)


def test_wide_tile_layouts(probe):
    """The 1 x 4 layout's wide tile: 128 rows, 32 columns a warp in one softmax chunk; d64 keeps two
    CTAs per SM with 3 stages, d128 (two stages of 64 KB do not fit beside another CTA) runs one CTA
    per SM with 3 stages; both fit the budget and keep the in-cluster combine. Other head dims have
    no wide tile, and the default tiles are today's (64 rows, 16 columns a warp)."""
    layouts, _ = probe()
    by = {(x["d"], x["tile"]): x for x in layouts}
    assert set(by) == {(d, 0) for d in HEAD_DIMS} | {(64, 128), (128, 128)}
    for d in HEAD_DIMS:
        assert by[d, 0]["tile_n"] == 64 and by[d, 0]["warp_n"] == 16 and by[d, 0]["chunk"] == 16
    w64, w128 = by[64, 128], by[128, 128]
    for w in (w64, w128):
        assert (w["tile_n"], w["warp_n"], w["chunk"]) == (128, 32, 32)
        assert w["cluster_combine"] == 1
        assert w["smem"] <= (115712 if w["ctas_per_sm"] == 2 else 232448)
    # Rows of whole 128-byte lines are swizzled, not padded (plan.h Layout::swizzle): K + V tiles of
    # 128 x d values a stage.
    assert (w64["ctas_per_sm"], w64["stages"], w64["stage_bytes"]) == (2, 3, 2 * 128 * 64 * 2)
    assert (w128["ctas_per_sm"], w128["stages"], w128["stage_bytes"]) == (1, 3, 2 * 128 * 128 * 2)
    # The default layouts the wide tile sits beside: d64 6 stages, d128 3, both two CTAs per SM.
    assert (by[64, 0]["stages"], by[64, 0]["ctas_per_sm"]) == (6, 2)
    assert (by[128, 0]["stages"], by[128, 0]["ctas_per_sm"]) == (3, 2)


@pytest.mark.parametrize("cluster_capable,policy", [(1, 0), (0, 0), (1, 1)],
                         ids=["clusters", "no-clusters", "fit"])
def test_wide_tile_plans(probe, cluster_capable, policy):
    """Over decode shapes, head dims and cache formats: with tile128 where the wide tile applies the
    splits are whole 128-row tiles (so every split is whole tiles of the engine), tile_rows is 128 and
    the plan stays within the split and cluster limits; elsewhere the plan is the one without it."""
    queries = []
    for (b, hq, hkv, s, c), d, bits in itertools.product(SHAPES, (64, 80, 128), (0, 8)):
        for wide in (0, 1):
            queries.append((b, hq, hkv, s, c, d, bits, cluster_capable, 0, -1, policy, wide))
    _, plans = probe(queries)
    assert len(plans) == len(queries)
    wide_seen = 0
    for q, default, wide in zip(queries[::2], plans[::2], plans[1::2]):
        b, hq, hkv, s, c, d, bits = q[:7]
        assert default["tile_rows"] in (32, 64)
        if not _wide_applies(hq, hkv, s, d, bits):
            assert wide == default, q
            continue
        wide_seen += 1
        assert wide["tile_rows"] == 128, q
        assert wide["split_rows"] % 128 == 0 and wide["split_rows"] > 0, q
        assert wide["splits"] == -(-c // wide["split_rows"]) and 1 <= wide["splits"] <= 256, q
        if wide["cluster"]:
            assert 2 <= wide["splits"] <= 16 and wide["workspace_elems"] == 1, q
        assert wide["ctas_per_sm"] == (2 if d == 64 else 1), q
        # Enough CTAs to fill the slots: one split, as without the wide tile.
        if b * hkv >= 0.8 * 132 * wide["ctas_per_sm"]:
            assert wide["splits"] == 1, q
    assert wide_seen > 100


def test_given_split_rows_and_the_tile(probe):
    """A given split_rows that is whole 128-row tiles keeps it and runs the wide tile; a multiple of
    64 that is not keeps it too, with the default tile (the handler's rule: the same)."""
    _, plans = probe([(8, 32, 8, 1, 4096, 64, 0, 1, 256, -1, 0, 1),
                      (8, 32, 8, 1, 4096, 64, 0, 1, 192, -1, 0, 1),
                      (8, 32, 8, 1, 4096, 64, 0, 1, 192, 1, 0, 1),
                      (8, 32, 8, 1, 700, 128, 0, 1, 128, 1, 0, 1)])
    assert (plans[0]["split_rows"], plans[0]["tile_rows"], plans[0]["splits"]) == (256, 128, 16)
    assert (plans[1]["split_rows"], plans[1]["tile_rows"]) == (192, 64)
    assert (plans[2]["split_rows"], plans[2]["tile_rows"], plans[2]["cluster"]) == (192, 64, 1)
    assert (plans[3]["split_rows"], plans[3]["tile_rows"], plans[3]["splits"], plans[3]["cluster"]) == (128, 128, 6, 1)


def test_issue_shapes(probe):
    """The plans of the shapes the device script times (32/8, q_len 1): B=32 16k one split at d64 and
    d128; B=8 / B=1 short contexts split into whole wide tiles."""
    shapes = [(32, 16384), (8, 2048), (8, 2304), (8, 4096), (8, 8192), (1, 2048), (1, 8192)]
    queries = [(b, 32, 8, 1, c, d, 0, 1, 0, -1, 0, 1) for b, c in shapes for d in (64, 128)]
    _, plans = probe(queries)
    for q, p in zip(queries, plans):
        assert p["tile_rows"] == 128 and p["split_rows"] % 128 == 0, (q, p)
    assert plans[0]["splits"] == 1 and plans[1]["splits"] == 1  # B=32 16k: 256 CTAs, one split


@pytest.mark.skipif(_extension._ffi is None or "wide_tile_n" not in (_extension.limits() or {}).get("decode", {}),
                    reason="the extension is not a build of this tree (no wide tile in its limits)")
def test_the_extension_exports_the_wide_tile_plan():
    """_ffi.decode_plan(tile128=True) and limits()['decode']['wide_tile_*'] are plan.h's."""
    lim = _extension.limits()["decode"]
    assert lim["wide_tile_n"] == 128 and list(lim["wide_tile_head_dims"]) == [64, 128]
    shapes = dict(batch=8, q_heads=32, kv_heads=8, q_len=1, capacity=2304, kv_bits=0, cluster_capable=True)
    for d in (64, 128):
        plan = _extension.decode_plan(head_dim=d, tile128=True, **shapes)
        assert plan["tile_rows"] == 128 and plan["split_rows"] % 128 == 0
        assert _extension.decode_plan(head_dim=d, **shapes)["tile_rows"] == 64
    assert _extension.decode_plan(head_dim=80, tile128=True, **shapes)["tile_rows"] == 64
