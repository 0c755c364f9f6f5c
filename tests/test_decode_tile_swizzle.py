"""The decode engine's K / V tile layout in shared memory (plan.h Layout::swizzle / tile_stride,
params.h TileChunk) on the CPU.

The host compiler builds a small program from the headers the kernels use (like
test_decode_plan_tile128.py), which prints every layout's tile geometry and TileChunk's map; the
tests check what the layout is for: every row's chunks are a permutation (no two chunks collide),
the 8 rows an ldmatrix reads at one logical chunk sit in 8 different 16-byte bank groups (no bank
conflict), and, where rows are whole 128-byte lines (swizzled), each 32-byte sector a cp.async copy
brings lands in one aligned 32-byte unit of shared memory: the property the padded rows lacked
(ncu on the H200, session 24: 1.5x the ideal L2 sectors, 2.6x the ideal shared wavefronts per copy).
"""

import json
import subprocess

import pytest

from host_plan import HEAD_DIMS, compile_program

_PROGRAM = r"""
#include <cstdio>
#include "kernels/decode/plan.h"
using namespace joa;
using namespace joa::decode;

static void Print(int d, int wm, int wn, int bits, bool in_regs, int tile_n) {
  const decode::Layout l = MakeLayout(d, wm, wn, 2, bits, in_regs, false, tile_n);
  std::printf("{\"d\":%d,\"wm\":%d,\"wn\":%d,\"bits\":%d,\"in_regs\":%d,\"tile_n\":%d,\"swizzle\":%d,"
              "\"tile_stride\":%d,\"stride\":%d,\"stage_bytes\":%d,\"conv_bytes\":%d,\"smem\":%d,\"map\":[",
              d, wm, wn, bits, int(in_regs), l.tile_n, int(l.swizzle), l.tile_stride, l.stride,
              l.stage_bytes, l.conv_bytes, l.smem_bytes);
  for (int r = 0; r < 16; ++r) {
    std::printf("%s[", r ? "," : "");
    for (int c = 0; c < d / 8; ++c) std::printf("%s%d", c ? "," : "", TileChunk(l.swizzle, r, c));
    std::printf("]");
  }
  std::printf("]}\n");
}

int main() {
  const int dims[] = {JOA_DECODE_HEAD_DIMS};
  const int warps[][2] = {{1, 4}, {2, 2}, {4, 1}, {8, 1}};
  for (int d : dims) {
    for (auto& w : warps) {
      Print(d, w[0], w[1], 0, false, 0);
      Print(d, w[0], w[1], 8, false, 0);
      Print(d, w[0], w[1], 4, true, 0);
    }
    if (d == 64 || d == 128) Print(d, 1, 4, 0, false, kWideTileN);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    exe = compile_program(tmp_path_factory.mktemp("swizzle"), _PROGRAM, "swizzle_probe")
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_which_layouts_swizzle(layouts):
    """Rows of whole 128-byte lines (d % 64 == 0) of a tile the MMAs read (float caches and the
    converted tile pair of a quantised one) are swizzled and unpadded; other head dims keep the
    16-byte padding; a cache dequantised in registers has no such tile. Q keeps its padded rows."""
    assert len(layouts) == len(HEAD_DIMS) * 12 + 2
    for x in layouts:
        swizzled = not x["in_regs"] and x["d"] % 64 == 0
        assert x["swizzle"] == int(swizzled), x
        assert x["tile_stride"] == (x["d"] if swizzled else x["d"] + 8)
        assert x["stride"] == x["d"] + 8
        if x["bits"] == 0:  # a stage is a K and a V tile as the MMAs read them
            assert x["stage_bytes"] == 2 * x["tile_n"] * x["tile_stride"] * 2
        elif not x["in_regs"]:  # the converted pair, then the K / V scales
            assert x["conv_bytes"] == 2 * x["tile_n"] * x["tile_stride"] * 2 + 2 * x["d"] * 4


def test_rows_keep_every_chunk(layouts):
    for x in layouts:
        for row in x["map"]:
            assert sorted(row) == list(range(x["d"] // 8)), x["d"]


def test_ldmatrix_reads_are_conflict_free(layouts):
    """An ldmatrix phase reads 8 rows r0..r0 + 7 (r0 a multiple of 8: the engine's tile columns c0
    and its 16-row steps) at one logical chunk: their 16-byte pieces must cover 8 different bank
    groups of a 128-byte line."""
    for x in layouts:
        if x["in_regs"]:
            continue
        row_bytes = 2 * x["tile_stride"]
        for r0 in (0, 8):
            for c in range(x["d"] // 8):
                groups = {((r0 + i) * row_bytes + 16 * x["map"][r0 + i][c]) % 128 // 16 for i in range(8)}
                assert len(groups) == 8, (x["d"], x["swizzle"], r0, c)


def test_swizzled_copies_keep_sectors_whole(layouts):
    """A 32-byte global sector is chunks 2a, 2a + 1 of a row: swizzled, both land in one aligned
    32-byte unit (so the copy is one L2 sector and one piece of a shared wavefront); padded, every
    odd row's sectors straddle two, which is what the swizzle removes."""
    for x in layouts:
        if x["in_regs"] or x["d"] % 16:
            continue
        row_bytes = 2 * x["tile_stride"]
        straddles = 0
        for r, row in enumerate(x["map"]):
            for a in range(x["d"] // 16):
                lo, hi = r * row_bytes + 16 * row[2 * a], r * row_bytes + 16 * row[2 * a + 1]
                whole = lo // 32 == hi // 32 and abs(hi - lo) == 16
                straddles += not whole
        assert (straddles == 0) == bool(x["swizzle"]), (x["d"], x["swizzle"], straddles)
