// matmul_nbits: onnxruntime's com.microsoft::MatMulNBits (bits 4 / 8) on the GEMV engine, weights
// dequantised in registers: y[M, N_out] = x[M, K] W^T, W[n, k] = (q[n, k] - zp[n, k / bs]) *
// scale[n, k / bs]. b_quant uint8 [N, k_blocks, bs * bits / 8] (element j of a block in bits
// (j % (8 / bits)) * bits of byte j / (8 / bits)); scales of x's dtype and zero points uint8
// (has_zero_points; else 2^(bits - 1)) tiled [ceil(N / 16), k_blocks, 16] (scale[n, b] at
// [n / 16, b, n % 16]; ops.linear.tile_nbits_meta). Fusions and attributes as linear.cu; wide: the
// two-piece n-bit format (ffi/kernels/gemv/plan.h's FormatInfo; jax_onnx_attn.ops.cuda_matmul
// chooses it, JOA_GEMV_NBITS_WIDE). rows: 4-bit weights in the rows layout instead
// (ffi/kernels/gemv/rows.cuh; jax_onnx_attn.ops.linear.pack_nbits_rows): b_quant uint8
// [ceil(N / 64), K / 16, 512], scales and zero points [ceil(N / 64), k_blocks, 64]; N from y (and
// gated); cluster / warps_n / depth / occupancy force that plan (0: planned); wide and slots do not
// apply. record_layout: one row of x against 4-bit weights in the record layout (ffi/kernels/gemv/slots.cuh's RecordFormat;
// jax_onnx_attn.ops.linear.to_record_layout): b_quant uint8 [N / 16, K / 256, 2432] holding W, scales
// and zero points (scales and zero_points are placeholders, has_zero_points ignored); N from y (and
// gated); on the slots kernel's plan (plan.h's MakeRecordPlan); the other plan attributes do not apply.
#include <string>
#include <utility>

#include "common/ffi.h"
#include "kernels/gemv/host.h"
#include "record/stage.h"

namespace joa {
namespace {

// The engine's parameters of one call, shapes checked (the optional operands: ConfigureExtras).
gemv::GemvParams Params(AnyBuffer x, AnyBuffer b_quant, AnyBuffer scales, AnyBuffer zero_points, AnyResult y,
                        int64_t n, int64_t n_out, int64_t k_blocks, int64_t block_size, bool has_zero_points,
                        float eps) {
  gemv::GemvParams p{};
  p.m = int(x.dimensions()[0]);
  p.k = int(x.dimensions()[1]);
  p.n_rows = int(n);
  p.n_out = int(n_out);
  p.k_blocks = int(k_blocks);
  p.block_shift = 0;
  while ((int64_t(1) << p.block_shift) < block_size) ++p.block_shift;
  p.x = x.untyped_data();
  p.w = b_quant.untyped_data();
  p.scales = scales.untyped_data();
  p.zeros = has_zero_points ? static_cast<const uint8_t*>(zero_points.untyped_data()) : nullptr;
  p.y = y->untyped_data();
  p.eps = eps;
  return p;
}

// Whether per-block metadata (scales, zero points) has this type and shape [d0, d1, d2].
bool IsMeta(const AnyBuffer& b, ffi::DataType type, int64_t d0, int64_t d1, int64_t d2) {
  auto d = b.dimensions();
  return b.element_type() == type && d.size() == 3 && d[0] == d0 && d[1] == d1 && d[2] == d2;
}

ffi::Error RowsImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer b_quant, AnyBuffer scales, AnyBuffer zero_points,
                    AnyBuffer bias, AnyBuffer residual, AnyBuffer norm_weight, AnyResult y, int64_t bits,
                    int64_t block_size, bool has_zero_points, bool has_bias, bool has_residual, bool has_norm,
                    bool gated, float eps, int64_t cluster, int64_t warps_n, int64_t depth, int64_t occupancy,
                    bool pdl) {
  constexpr const char* kOp = "matmul_nbits (rows layout)";
  const ffi::DataType dtype = x.element_type();
  auto xd = x.dimensions(), bd = b_quant.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (bits != 4) return InvalidArgument(std::string(kOp) + ": bits must be 4");
  if (block_size != 32 && block_size != 128) return InvalidArgument(std::string(kOp) + ": block_size must be 32 or 128");
  if (xd.size() != 2 || yd.size() != 2 || bd.size() != 3 || sd.size() != 3) {
    return InvalidArgument(std::string(kOp) + ": x [M, K], b_quant [ceil(N / 64), K / 16, 512], scales "
                           "[ceil(N / 64), k_blocks, 64], y [M, N_out]");
  }
  if (b_quant.element_type() != ffi::DataType::U8 || scales.element_type() != dtype || y->element_type() != dtype) {
    return InvalidArgument(std::string(kOp) + ": b_quant must be uint8; scales and y of x's dtype");
  }
  const int64_t m = xd[0], k = xd[1], n = gated ? 2 * yd[1] : yd[1];
  if (yd[0] != m || m < 1 || m > gemv::kMaxM || k < block_size || k % block_size != 0 || k > (int64_t(1) << 30) ||
      n > (int64_t(1) << 30)) {
    return InvalidArgument(std::string(kOp) + ": shape out of range (M 1..32, K a multiple of block_size)");
  }
  const int64_t groups = (n + gemv::kRowsGroup - 1) / gemv::kRowsGroup, k_blocks = k / block_size;
  if (bd[0] != groups || bd[1] != k / 16 || bd[2] != 512) {
    return InvalidArgument(std::string(kOp) + ": b_quant must be uint8 [ceil(N / 64), K / 16, 512]");
  }
  if (!IsMeta(scales, dtype, groups, k_blocks, gemv::kRowsGroup)) {
    return InvalidArgument(std::string(kOp) + ": scales must be [ceil(N / 64), k_blocks, 64]");
  }
  if (has_zero_points && !IsMeta(zero_points, ffi::DataType::U8, groups, k_blocks, gemv::kRowsGroup)) {
    return InvalidArgument(std::string(kOp) + ": zero_points must be uint8 [ceil(N / 64), k_blocks, 64]");
  }
  gemv::GemvParams p = Params(x, b_quant, scales, zero_points, y, n, yd[1], k_blocks, block_size,
                              has_zero_points, eps);
  std::string err = gemv::ConfigureExtras(p, dtype, bias, residual, norm_weight, has_bias, has_residual, has_norm);
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  return gemv::RowsPlanAndLaunch(p, dtype, gemv::Fusion{gated, has_norm}, block_size, cluster, warps_n, depth,
                                 occupancy, pdl, stream, kOp);
}

ffi::Error RecordImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer b_quant, AnyBuffer scales, AnyBuffer zero_points,
                      AnyBuffer bias, AnyBuffer residual,
                      AnyBuffer norm_weight, AnyResult y, int64_t bits, int64_t block_size, bool has_bias,
                      bool has_residual, bool has_norm, bool gated, float eps, bool pdl) {
  constexpr const char* kOp = "matmul_nbits (record layout)";
  const ffi::DataType dtype = x.element_type();
  auto xd = x.dimensions(), bd = b_quant.dimensions(), yd = y->dimensions();
  if (bits != 4) return InvalidArgument(std::string(kOp) + ": bits must be 4");
  if (xd.size() != 2 || yd.size() != 2 || bd.size() != 3) {
    return InvalidArgument(std::string(kOp) + ": x [1, K], b_quant [N / 16, K / 256, 2432], y [1, N_out]");
  }
  if (b_quant.element_type() != ffi::DataType::U8 || y->element_type() != dtype) {
    return InvalidArgument(std::string(kOp) + ": b_quant must be uint8; y of x's dtype");
  }
  const int64_t m = xd[0], k = xd[1], n = gated ? 2 * yd[1] : yd[1];
  if (m != 1 || yd[0] != 1) return InvalidArgument(std::string(kOp) + ": x and y must have one row");
  if (k % gemv::kRecordK != 0 || n % gemv::kRecordRows != 0 || k > (int64_t(1) << 30) || n > (int64_t(1) << 30) ||
      bd[0] != n / gemv::kRecordRows || bd[1] != k / gemv::kRecordK || bd[2] != gemv::kRecordBytes) {
    return InvalidArgument(std::string(kOp) + ": b_quant must be uint8 [N / 16, K / 256, 2432] (N, K of y, x)");
  }
  if (block_size < 32 || block_size > (int64_t(1) << 20) || (block_size & (block_size - 1)) || k % block_size != 0) {
    return InvalidArgument(std::string(kOp) + ": block_size must be a power of two >= 32 dividing K");
  }
  gemv::GemvParams p = Params(x, b_quant, scales, zero_points, y, n, yd[1], k / block_size, block_size, false, eps);
  p.scales = nullptr;  // the records hold the scales and zero points
  std::string err = gemv::ConfigureExtras(p, dtype, bias, residual, norm_weight, has_bias, has_residual, has_norm);
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  return gemv::RecordPlanAndLaunch(p, dtype, gemv::Fusion{gated, has_norm}, block_size, pdl, stream, kOp);
}

ffi::Error MatMulNBitsImpl(cudaStream_t stream, AnyBuffer x, AnyBuffer b_quant, AnyBuffer scales,
                           AnyBuffer zero_points, AnyBuffer bias, AnyBuffer residual,
                           AnyBuffer norm_weight, AnyResult y, int64_t bits, int64_t block_size,
                           bool has_zero_points, bool has_bias, bool has_residual, bool has_norm,
                           bool gated, float eps, int64_t cluster, int64_t warps_k, bool wide,
                           bool pdl, bool slots, bool rows, int64_t warps_n, int64_t depth,
                           int64_t occupancy, bool record_layout) {
  if (record_layout) {
    return RecordImpl(stream, x, b_quant, scales, zero_points, bias, residual, norm_weight, y, bits, block_size, has_bias, has_residual,
                      has_norm, gated, eps, pdl);
  }
  if (rows) {
    return RowsImpl(stream, x, b_quant, scales, zero_points, bias, residual, norm_weight, y, bits, block_size,
                    has_zero_points, has_bias, has_residual, has_norm, gated, eps, cluster, warps_n, depth,
                    occupancy, pdl);
  }
  constexpr const char* kOp = "matmul_nbits";
  const ffi::DataType dtype = x.element_type();
  auto xd = x.dimensions(), bd = b_quant.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (bits != 4 && bits != 8) return InvalidArgument("matmul_nbits: bits must be 4 or 8");
  // Each 16-byte piece of a lane must lie in one block (its scale and zero point); the format's
  // pieces are piece_k = lane_stride elements long, one or (wide) two a lane.
  const int64_t piece_k = gemv::Format(int(bits), wide).lane_stride;
  if (block_size < piece_k || block_size > (int64_t(1) << 20) || (block_size & (block_size - 1))) {
    return InvalidArgument("matmul_nbits: block_size must be a power of two >= " + std::to_string(piece_k));
  }
  if (xd.size() != 2 || bd.size() != 3 || sd.size() != 3 || yd.size() != 2) {
    return InvalidArgument("matmul_nbits: x [M, K], b_quant [N, k_blocks, blob], scales [ceil(N / 16), k_blocks, 16], y [M, N_out]");
  }
  if (b_quant.element_type() != ffi::DataType::U8 || scales.element_type() != dtype ||
      y->element_type() != dtype) {
    return InvalidArgument("matmul_nbits: b_quant must be uint8; scales and y of x's dtype");
  }
  const int64_t n = bd[0], k_blocks = bd[1];
  if (bd[2] * 8 != block_size * bits || xd[1] != k_blocks * block_size) {
    return InvalidArgument("matmul_nbits: b_quant must be [N, K / block_size, block_size * bits / 8]");
  }
  const int64_t tiles = (n + gemv::kMetaTileRows - 1) / gemv::kMetaTileRows;
  if (sd[0] != tiles || sd[1] != k_blocks || sd[2] != gemv::kMetaTileRows) {
    return InvalidArgument("matmul_nbits: scales must be tiled [ceil(N / 16), k_blocks, 16]");
  }
  if (has_zero_points && !IsMeta(zero_points, ffi::DataType::U8, tiles, k_blocks, gemv::kMetaTileRows)) {
    return InvalidArgument("matmul_nbits: zero_points must be uint8 tiled [ceil(N / 16), k_blocks, 16]");
  }
  const int64_t n_out = gated ? n / 2 : n;
  if (yd[0] != xd[0] || yd[1] != n_out) return InvalidArgument("matmul_nbits: y must be [M, N_out]");
  if (xd[0] < 1 || xd[0] > gemv::kMaxM || n > (int64_t(1) << 30) || xd[1] > (int64_t(1) << 30)) {
    return InvalidArgument("matmul_nbits: shape out of range");
  }
  gemv::GemvParams p = Params(x, b_quant, scales, zero_points, y, n, n_out, k_blocks, block_size,
                              has_zero_points, eps);
  std::string err = gemv::ConfigureExtras(p, dtype, bias, residual, norm_weight, has_bias,
                                          has_residual, has_norm);
  if (!err.empty()) return InvalidArgument(std::string(kOp) + ": " + err);
  return gemv::PlanAndLaunch(p, dtype, int(bits), gemv::Fusion{gated, has_norm}, cluster, warps_k,
                             wide, pdl, stream, kOp, block_size, slots);
}


// matmul_nbits' operands and attributes, after the stage's context: one list for both stages.
template <class Binding>
auto MatMulNBitsOperands(Binding binding) {
  return std::move(binding)
      .template Arg<joa::AnyBuffer>()  // x [M, K]
      .template Arg<joa::AnyBuffer>()  // b_quant uint8 [N, k_blocks, blob] (or a layout's: rows, record)
      .template Arg<joa::AnyBuffer>()  // scales [ceil(N / 16), k_blocks, 16]
      .template Arg<joa::AnyBuffer>()  // zero_points uint8, scales' shape (or placeholder)
      .template Arg<joa::AnyBuffer>()  // bias [N] (or placeholder)
      .template Arg<joa::AnyBuffer>()  // residual [M, N_out] (or placeholder)
      .template Arg<joa::AnyBuffer>()  // norm_weight [K] (or placeholder)
      .template Ret<joa::AnyBuffer>()  // y [M, N_out]
      .template Attr<int64_t>("bits")
      .template Attr<int64_t>("block_size")
      .template Attr<bool>("has_zero_points")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_residual")
      .template Attr<bool>("has_norm")
      .template Attr<bool>("gated")
      .template Attr<float>("eps")
      .template Attr<int64_t>("cluster")
      .template Attr<int64_t>("warps_k")
      .template Attr<bool>("wide")
      .template Attr<bool>("pdl")
      .template Attr<bool>("slots")
      .template Attr<bool>("rows")
      .template Attr<int64_t>("warps_n")
      .template Attr<int64_t>("depth")
      .template Attr<int64_t>("occupancy")
      .template Attr<bool>("record_layout");
}
}  // namespace
}  // namespace joa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaMatMulNBits, joa::MatMulNBitsImpl,
                              joa::MatMulNBitsOperands(xla::ffi::Ffi::Bind().Ctx<joa::Stream>()),
                              JOA_COMMAND_BUFFER_SAFE);

#if JOA_HAVE_FFI_RECORD
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoaMatMulNBitsRecord, joa::record::Stage<joa::MatMulNBitsImpl>::Record,
                              joa::MatMulNBitsOperands(xla::ffi::Ffi::BindRecord().Ctx<joa::record::RecordCtx>()));
#endif
