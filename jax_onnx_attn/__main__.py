"""`python -m jax_onnx_attn`: the `jax-onnx-attn` command (see jax_onnx_attn.cli)."""

import sys

from jax_onnx_attn.cli import main

if __name__ == "__main__":
    sys.exit(main())
