"""Public JAX ops. Each validates its inputs at trace time and runs on the reference or CUDA backend."""

from jax_onnx_attn.ops import status
from jax_onnx_attn.ops.kv_cache import kv_append

__all__ = ["kv_append", "status"]
from jax_onnx_attn.ops.attention import (AttentionOutputs, CachedAttentionOutputs, attention,
                                         attention_with_cache)

__all__ += ["attention", "attention_with_cache", "AttentionOutputs", "CachedAttentionOutputs"]
from jax_onnx_attn.ops.gqa import GroupQueryAttentionOutput, QkvProjection, group_query_attention

__all__ += ["group_query_attention", "GroupQueryAttentionOutput", "QkvProjection"]
from jax_onnx_attn.ops.linear import (deinterleave_gate_up, from_record_layout, from_rotary_pair_order,
                                      from_rows_layout, gated_mlp, interleave_gate_up, interleave_gate_up_nbits,
                                      linear, matmul_nbits, out_mlp, pack_nbits_rows, prepare_nbits,
                                      rotary_pair_order, tile_nbits_meta, to_record_layout,
                                      to_rotary_pair_order, to_rows_layout, untile_nbits_meta)

__all__ += ["linear", "gated_mlp", "out_mlp", "matmul_nbits", "prepare_nbits", "interleave_gate_up", "deinterleave_gate_up",
            "interleave_gate_up_nbits", "tile_nbits_meta", "untile_nbits_meta", "to_rows_layout",
            "from_rows_layout", "pack_nbits_rows", "to_record_layout", "from_record_layout",
            "rotary_pair_order", "to_rotary_pair_order", "from_rotary_pair_order"]
