"""Static SASS instructions of the GEMV engine's chunk loop (its hot path: the loop head to the
branch that continues with the next chunk of the same row block, plus the latch), per kernel.

    nvcc -c -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -O3 -Iffi \\
        ffi/kernels/gemv/inst/gemv_f16_int4_wide.cu -o /tmp/int4w.o
    cuobjdump -sass /tmp/int4w.o > /tmp/int4w.sass   # pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm
    python3 tools/probes/gemv_sass.py /tmp/int4w.sass Li1ENS0_10PlainInputENS0_13StoreEpilogue

The substrings pick kernels by mangled name (Li1E...: one n8 tile, M <= 8; plain x; stored y).
Counts are static: the ring wait's jump table and the copy paths a lane does not take count too.
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sass_loop import functions  # noqa: E402  (the listing's parser, shared with tools/sass_loop.py)


def hot_path(body):
    """The instructions of the chunk loop's hot path."""
    branches = [(a, int(t.group(1), 16)) for a, i in body if re.search(r"\bBRA\b", i)
                for t in [re.search(r"0x([0-9a-f]+)", i)] if t]
    mma = [a for a, i in body if "HMMA" in i]
    latch = max(((a, t) for a, t in branches if t <= min(mma) and a >= max(mma)),
                key=lambda at: at[0] - at[1])
    cont = min((a, t) for a, t in branches if a > max(mma) and latch[0] - 0x100 <= t <= latch[0])
    return [i for a, i in body if latch[1] <= a <= cont[0] or cont[1] <= a <= latch[0]]


def main(path, *subs):
    for name, body in functions(open(path).read()).items():
        if all(s in name for s in subs):
            ins = hot_path(body)
            kinds = {k: sum(bool(re.search(p, i)) for i in ins) for k, p in
                     (("HMMA", r"HMMA"), ("LDS", r"\bLDS"), ("LDGSTS", r"LDGSTS"),
                      ("HFMA2/HMUL2/HADD2", r"\bH(FMA2|MUL2|ADD2)"), ("LOP3", r"LOP3"), ("PRMT", r"PRMT"))}
            print(f"{len(ins):4d} {kinds} {name}")


if __name__ == "__main__":
    main(*sys.argv[1:])
