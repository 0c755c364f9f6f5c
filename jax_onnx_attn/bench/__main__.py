"""`python -m jax_onnx_attn.bench <suite> [options]`: benchmark suites (decode, gqa, e2e)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv[0]` to its suite's main; 2 with a usage line for an unknown suite."""
    argv = list(sys.argv[1:] if argv is None else argv)
    suites = ("decode", "gqa", "e2e")
    if not argv or argv[0] not in suites:
        print(f"usage: python -m jax_onnx_attn.bench {{{','.join(suites)}}} [--help]", file=sys.stderr)
        return 2
    if argv[0] == "e2e":
        from jax_onnx_attn.bench import e2e
        return e2e.main(argv[1:])
    if argv[0] == "gqa":
        from jax_onnx_attn.bench import gqa
        return gqa.main(argv[1:])
    from jax_onnx_attn.bench import decode
    return decode.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
