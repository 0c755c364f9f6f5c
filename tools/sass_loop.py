"""Opcode counts of a kernel's main loop, from its SASS, without a GPU (session 29).

    python tools/sass_loop.py OBJ_OR_SASS PATTERN [PATTERN ...] [--dump]

OBJ_OR_SASS: an object / cubin / .so (disassembled with `cuobjdump -sass`, which needs `nvdisasm`
on PATH; both come with the CUDA toolkit or the nvidia-cuda-cuobjdump / -nvdisasm wheels) or a
saved `cuobjdump -sass` listing. Every function whose mangled name contains all PATTERNs is shown:
its instruction count and the loop around its last HMMA (from the branch target of the first
backward branch after it to that branch), as static counts by opcode. Static: the loop's cold
blocks (partial tiles, a rescale taken rarely, a first-iteration set-up) are counted too, so compare
two builds of one kernel rather than reading the numbers as issued instructions. --skip-over OP
leaves out the longest block a forward branch inside the loop jumps over that holds an OP
instruction (the decode kernels' first-iteration set-up: `--skip-over LDSM`, Q's fragments loaded
once). --dump prints the loop's instructions. The GEMV engine's chunk loop: tools/probes/gemv_sass.py
(same parser).
"""

import argparse
import collections
import re
import subprocess
import sys


def functions(text):
    """{mangled name: [(address, instruction)]} of a cuobjdump -sass listing."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(ins):
    words = ins.split()
    if words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0]


def main_loop(ins):
    """The instructions of the loop that holds the function's last HMMA, or [] if none."""
    mma = [i for i, (_, s) in enumerate(ins) if "HMMA" in s]
    if not mma:
        return []
    for j in range(mma[-1], len(ins)):
        m = re.search(r"BRA\s+(?:\S+,\s*)?(0x[0-9a-f]+)", ins[j][1])
        if m and int(m.group(1), 16) <= ins[mma[-1]][0]:
            target = int(m.group(1), 16)
            start = next(i for i, (a, _) in enumerate(ins) if a == target)
            return ins[start:j + 1]
    return []


def skip_over(loop, op):
    """loop less the longest block a forward branch in it jumps over that holds an `op`."""
    addr = {a: i for i, (a, _) in enumerate(loop)}
    best = None
    for i, (_, s) in enumerate(loop):
        m = re.search(r"BRA\s+(?:\S+,\s*)?(0x[0-9a-f]+)", s)
        j = addr.get(int(m.group(1), 16)) if m else None
        if j is not None and j > i + 1 and any(op in x for _, x in loop[i + 1:j]):
            if best is None or j - i > best[1] - best[0]:
                best = (i + 1, j)
    return loop if best is None else loop[:best[0]] + loop[best[1]:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--skip-over", metavar="OP")
    ap.add_argument("--dump", action="store_true")
    args = ap.parse_args(argv)
    if args.path.endswith((".sass", ".txt")):
        text = open(args.path).read()
    else:
        text = subprocess.run(["cuobjdump", "-sass", args.path], check=True, capture_output=True,
                              text=True).stdout
    found = False
    for name, ins in functions(text).items():
        if not all(p in name for p in args.patterns):
            continue
        found = True
        loop = main_loop(ins)
        if args.skip_over:
            loop = skip_over(loop, args.skip_over)
        counts = collections.Counter(opcode(s) for _, s in loop)
        print(f"{name}\n  {len(ins)} instructions; main loop {len(loop)}: "
              + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
        if args.dump:
            for a, s in loop:
                print(f"    {a:#07x}  {s}")
    if not found:
        sys.exit(f"no function matches {args.patterns}")


if __name__ == "__main__":
    main()
