"""The prefill engine's named schedules and tilings (ffi/kernels/prefill/params.h) on the CPU.

params.h is host-only C++: these tests compile it with the host compiler into a small program that
prints every schedule's spec and, per head size, the tiling it runs (TunedTiling), whether its tuned
kernel is compiled there (TuneCompiled) and its shared memory (SmemBytes) as JSON, so they check this
tree's header even where the installed extension is another build's. The rules: the schedules before
the D 64 tunings keep their names, specs and tilings (bench JSON names them); the D 64 tilings are
the ones docs/kernels.md names and fit the hardware (wgmma N / TMA box <= 256 keys, 227 KB, the
consumer's registers); the defaults (TilingFor) are unchanged.
"""

import json
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("clang++")

_PROGRAM = r"""
#include <cstdio>
#include "kernels/prefill/params.h"
using namespace joa::prefill;

int main() {
  for (int i = 0; i < kNumSchedules; ++i) {
    std::printf("{\"kind\":\"schedule\",\"name\":\"%s\",\"base\":%d,\"tune\":%d}\n", kScheduleNames[i],
                int(kScheduleSpecs[i].base), kScheduleSpecs[i].tune);
  }
  for (int d : kHeadDims) {
    const Tiling plain = TilingFor(d);
    std::printf("{\"kind\":\"default\",\"d\":%d,\"padded\":%d,\"block_n\":%d,\"stages\":%d,\"schedule\":\"%s\"}\n",
                d, plain.padded, plain.block_n, plain.stages, kScheduleNames[plain.schedule]);
    for (int i = 0; i < kNumSchedules; ++i) {
      const int tune = kScheduleSpecs[i].tune;
      const Tiling t = TunedTiling(d, tune);
      std::printf("{\"kind\":\"tiling\",\"d\":%d,\"name\":\"%s\",\"compiled\":%d,\"padded\":%d,\"block_n\":%d,"
                  "\"stages\":%d,\"block_m\":%d,\"consumers\":%d,\"threads\":%d,\"regs\":%d,\"smem\":%lld}\n",
                  d, kScheduleNames[i], int(TuneCompiled(d, tune)), t.padded, t.block_n, t.stages, t.block_m,
                  Consumers(t), Threads(t), ConsumerRegisters(t), (long long)SmemBytes(d, tune));
    }
  }
  std::printf("{\"kind\":\"limits\",\"max_block_n\":%d,\"max_smem\":%lld,\"block_m\":%d,\"producer_regs\":%d}\n",
              kMaxBlockN, (long long)kMaxSmemBytes, kBlockM, kProducerRegisters);
  return 0;
}
"""

OLD_SCHEDULES = ("serial", "overlap", "pingpong", "pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy",
                 "pingpong-n176", "pingpong-fold-lazy-n176")
D64_SCHEDULES = ("pingpong-fold-lazy-s4", "pingpong-n192", "pingpong-fold-lazy-n192", "pingpong-fold-lazy-n192-s4",
                 "pingpong-fold-lazy-m192", "pingpong-fold-lazy-m192-s4")
#: (keys per step, stages, query rows) of each D 64 tiling (docs/kernels.md "D 64 tilings").
D64_TILINGS = {"pingpong-fold-lazy-s4": (128, 4, 128), "pingpong-n192": (192, 2, 128),
               "pingpong-fold-lazy-n192": (192, 2, 128), "pingpong-fold-lazy-n192-s4": (192, 4, 128),
               "pingpong-fold-lazy-m192": (128, 2, 192), "pingpong-fold-lazy-m192-s4": (128, 4, 192)}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    if CXX is None:
        pytest.skip("no host C++ compiler")
    tmp = tmp_path_factory.mktemp("prefill_params")
    src, exe = tmp / "prefill_params.cc", tmp / "prefill_params"
    src.write_text(_PROGRAM)
    subprocess.run([CXX, "-std=c++17", "-O1", "-I", str(ROOT / "ffi"), str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    kinds = {}
    for r in rows:
        kinds.setdefault(r.pop("kind"), []).append(r)
    return kinds


def _tiling(probe, d, name):
    (t,) = [t for t in probe["tiling"] if t["d"] == d and t["name"] == name]
    return t


def test_schedule_names_extend_the_old_ones(probe):
    names = tuple(s["name"] for s in probe["schedule"])
    assert names == OLD_SCHEDULES + D64_SCHEDULES
    specs = [(s["base"], s["tune"]) for s in probe["schedule"]]
    assert len(set(specs)) == len(specs)  # one name per spec: ScheduleIndex is unambiguous
    assert all(s["base"] == 2 for s in probe["schedule"][2:])  # every tune is pingpong's


def test_defaults(probe):
    """TilingFor: D 64 runs pingpong-fold-lazy-m192-s4 (measured on the H200, session 18; its plain
    tiling fields stay 128 keys x 2 stages), D 128 pingpong-fold-lazy, D 256 overlap."""
    defaults = {t.pop("d"): t for t in probe["default"]}
    assert defaults[64] == {"padded": 64, "block_n": 128, "stages": 2, "schedule": "pingpong-fold-lazy-m192-s4"}
    assert defaults[128] == {"padded": 128, "block_n": 128, "stages": 2, "schedule": "pingpong-fold-lazy"}
    assert defaults[256] == {"padded": 256, "block_n": 80, "stages": 2, "schedule": "overlap"}


def test_d128_tunings_are_unchanged(probe):
    for name in OLD_SCHEDULES[3:]:
        t = _tiling(probe, 128, name)
        assert t["compiled"] and t["stages"] == 2 and (t["block_m"], t["threads"], t["regs"]) == (128, 384, 240)
        assert t["block_n"] == (176 if name.endswith("n176") else 128), name
    assert _tiling(probe, 128, "pingpong-n176")["smem"] == 2 * 128 * (128 + 2 * 2 * 176) + 1280
    for name in D64_SCHEDULES:  # the D 64 tilings are not compiled at 128: plain pingpong there
        t = _tiling(probe, 128, name)
        assert not t["compiled"] and (t["block_n"], t["stages"], t["block_m"]) == (128, 2, 128), name


def test_d64_tilings(probe):
    """fold / lazy now compiled at D 64 on the plain tiling; the 176-key tile is D 128's only; the D 64
    tilings as documented, within the shared memory a CTA may have."""
    for name in ("pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy"):
        t = _tiling(probe, 64, name)
        assert t["compiled"] and (t["block_n"], t["stages"]) == (128, 2), name
    for name in ("pingpong-n176", "pingpong-fold-lazy-n176"):
        t = _tiling(probe, 64, name)
        assert not t["compiled"] and (t["block_n"], t["stages"]) == (128, 2), name
    for name, (block_n, stages, block_m) in D64_TILINGS.items():
        t = _tiling(probe, 64, name)
        assert t["compiled"], name
        assert (t["padded"], t["block_n"], t["stages"], t["block_m"]) == (64, block_n, stages, block_m), name
        assert t["smem"] == 2 * 64 * (block_m + 2 * stages * block_n) + 1280
    assert _tiling(probe, 64, "pingpong-fold-lazy-n192-s4")["smem"] == 214272  # 209 KB


def test_three_consumer_tiling(probe):
    """kTuneM192: 192 query rows, three consumer warpgroups at 160 registers and a producer at 24
    within the 64 K registers of an SM; every other tiling keeps two consumers at 240."""
    (limits,) = probe["limits"]
    for t in probe["tiling"]:
        three = t["compiled"] and "m192" in t["name"]
        assert (t["consumers"], t["threads"], t["regs"]) == ((3, 512, 160) if three else (2, 384, 240)), t
        assert 128 * (limits["producer_regs"] + t["consumers"] * t["regs"]) <= 65536


def test_no_tune_compiled_at_other_head_dims(probe):
    for t in probe["tiling"]:
        if t["d"] not in (64, 128):
            assert not t["compiled"], t


def test_every_tiling_fits_the_hardware(probe):
    """wgmma N and TMA box rows <= 256 (and kMaxBlockN, the handler's row check), whole 16-key
    k-steps, query rows whole warpgroups, 227 KB of shared memory, S + P + O of a consumer thread
    leaving 32 of its registers."""
    (limits,) = probe["limits"]
    for t in probe["tiling"]:
        assert t["block_n"] % 16 == 0 and t["block_n"] <= min(256, limits["max_block_n"]), t
        assert t["block_m"] % 64 == 0 and t["block_m"] <= 256, t
        assert t["smem"] <= limits["max_smem"], t
        assert t["block_n"] // 2 + t["block_n"] // 4 + t["padded"] // 2 <= t["regs"] - 32, t
    assert limits["max_block_n"] == max(t["block_n"] for t in probe["tiling"]) == 192
