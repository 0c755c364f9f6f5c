"""Benchmarks: this project and its peers in one process on the same GPU (see `python -m jax_onnx_attn.bench`)."""
