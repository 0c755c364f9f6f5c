// Every FFI handler symbol the module exports, and the table module.cc registers them from.
// Target names are prefixed "jax_onnx_attn_" on the Python side (jax_onnx_attn/_extension.py).
#pragma once

#include "xla/ffi/api/ffi.h"

#ifdef JOA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaKvAppend);  // ffi/handlers/kv_append.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaDecodeAttention);  // ffi/handlers/decode_attention.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaGqaPrepare);  // ffi/handlers/gqa_prepare.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaGeneralAttention);  // ffi/handlers/general_attention.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaPrefillAttention);  // ffi/handlers/prefill_attention.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaLinear);  // ffi/handlers/linear.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaMatMulNBits);  // ffi/handlers/matmul_nbits.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaLinearGqaPrepare);  // ffi/handlers/linear_gqa_prepare.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaGatedMlp);  // ffi/handlers/gated_mlp.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaOutMlp);    // ffi/handlers/gated_mlp.cu
#endif
#if JOA_HAVE_FFI_RECORD  // their record stages (ffi/record/stage.h)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaLinearRecord);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaMatMulNBitsRecord);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JoaLinearGqaPrepareRecord);
#endif

namespace joa {

struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};

#ifdef JOA_WITH_CUDA
inline constexpr Target kTargets[] = {
    {"kv_append", JoaKvAppend},
    {"decode_attention", JoaDecodeAttention},
    {"gqa_prepare", JoaGqaPrepare},
    {"general_attention", JoaGeneralAttention},
    {"prefill_attention", JoaPrefillAttention},
    {"linear", JoaLinear},
    {"matmul_nbits", JoaMatMulNBits},
    {"linear_gqa_prepare", JoaLinearGqaPrepare},
    {"gated_mlp", JoaGatedMlp},
    {"out_mlp", JoaOutMlp},
};
#else
inline constexpr Target* kTargets = nullptr;
#endif

// Targets that also have a record stage: XLA adds their kernels to its command buffers as kernel
// nodes (programmatic dependent launches across calls) instead of stream-captured child graphs.
// Registered through XLA's C API rather than jax (ffi/record/registry.h).
struct RecordTarget {
  const char* name;
  XLA_FFI_Handler* execute;
  XLA_FFI_Handler* record;
};

#if JOA_HAVE_FFI_RECORD
inline constexpr RecordTarget kRecordTargets[] = {
    {"linear", JoaLinear, JoaLinearRecord},
    {"matmul_nbits", JoaMatMulNBits, JoaMatMulNBitsRecord},
    {"linear_gqa_prepare", JoaLinearGqaPrepare, JoaLinearGqaPrepareRecord},
};
#endif

}  // namespace joa
