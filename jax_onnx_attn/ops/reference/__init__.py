"""Reference backend: pure jax.numpy / lax implementations, the executable spec for the kernels."""
