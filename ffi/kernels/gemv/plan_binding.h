// Exports the GEMV plan (ffi/kernels/gemv/plan.h) to Python as jax_onnx_attn._ffi.gemv_plan: the
// ops route shapes the engine does not take to the reference, and the benchmarks report the plan.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "kernels/gemv/mlp_row.h"
#include "kernels/gemv/plan.h"
#include "kernels/gemv/row_chain.h"

namespace joa::gemv {

inline void BindPlan(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("gemv_plan",
        [](int64_t rows, int64_t n_rows, int64_t k, int bits, bool gated, bool norm, bool sm90,
           int64_t cluster, int64_t warps_k, bool wide, int64_t block_size, bool slots, bool rows_layout,
           int64_t warps_n, int64_t depth, int64_t occupancy, bool record_layout) {
          Plan p;
          if (record_layout) {
            p = bits == 4 ? MakeRecordPlan(rows, n_rows, k, block_size, gated, norm, sm90) : Plan{};
            if (bits != 4) p.error = "record layout: 4-bit weights only";
          } else if (rows_layout) {
            p = bits == 4 ? MakeRowsPlan(rows, n_rows, k, block_size, gated, norm, sm90, cluster, warps_n, depth,
                                         occupancy)
                          : Plan{};
            if (bits != 4) p.error = "rows layout: 4-bit weights only";
          } else {
            p = MakePlan(rows, n_rows, k, bits, gated, norm, sm90, cluster, warps_k, wide, block_size, slots);
          }
          nb::dict d;
          d["error"] = p.error.empty() ? nb::object(nb::none()) : nb::object(nb::str(p.error.c_str()));
          d["m"] = p.m; d["n_rows"] = p.n_rows; d["n_out"] = p.n_out; d["k"] = p.k; d["bits"] = p.bits;
          d["nt"] = p.nt; d["quads"] = p.quads; d["lane_k"] = p.lane_k; d["chunk_k"] = p.chunk_k;
          d["lane_stride"] = p.lane_stride; d["quad_stride"] = p.quad_stride;
          d["pieces"] = p.pieces; d["piece_stride"] = p.piece_stride; d["wide"] = p.wide;
          d["stage_bytes"] = p.stage_bytes;
          d["kc"] = p.kc; d["cluster"] = p.cluster; d["warps_n"] = p.warps_n; d["warps_k"] = p.warps_k;
          d["cpp"] = p.cpp; d["stages"] = p.stages; d["slice_chunks"] = p.slice_chunks;
          d["rows_block"] = p.rows_block; d["blocks"] = p.blocks; d["groups"] = p.groups;
          d["grid"] = p.grid; d["waves"] = p.waves; d["ctas_per_sm"] = p.ctas_per_sm;
          d["norm"] = p.norm; d["x_bytes"] = p.x_bytes; d["red_bytes"] = p.red_bytes; d["smem_bytes"] = p.smem_bytes;
          d["est_us"] = p.est_us;
          d["slots"] = p.slots;
          d["dense_row"] = p.dense_row;
          d["rows_layout"] = p.rows;
          d["record_layout"] = p.record;
          return d;
        },
        nb::arg("rows"), nb::arg("n_rows"), nb::arg("k"), nb::arg("bits"), nb::arg("gated"), nb::arg("norm"),
        nb::arg("sm90"), nb::arg("cluster") = 0, nb::arg("warps_k") = 0, nb::arg("wide") = false,
        nb::arg("block_size") = 0, nb::arg("slots") = false, nb::arg("rows_layout") = false,
        nb::arg("warps_n") = 0, nb::arg("depth") = 0, nb::arg("occupancy") = 0, nb::arg("record_layout") = false,
        "The GEMV engine's launch plan for x [rows, k] and a weight of n_rows rows of `bits`-bit "
        "elements (16 dense, 8, 4), with the RMS-norm prologue or not, on an sm_90+ GPU (sm90) or an older one, "
        "n-bit weights in the two-piece format (wide) or not, their block_size, whether one row of "
        "4-bit wide weights may take the slots kernel and one row of dense weights the dense row kernel "
        "(slots), or for 4-bit weights in the rows layout (rows_layout: the rows kernel; cluster, warps_n, "
        "depth, occupancy > 0 force its K split, warps a CTA, W stages in flight a warp and CTAs an SM "
        "its registers are capped for ('ctas_per_sm')), or for one row of 4-bit weights in the record layout (record_layout: the "
        "slots kernel reading records, 'record_layout' in the dict; block_size as for slots): a dict of its "
        "fields, 'error' None when the engine takes it.");
  m.def("gated_mlp_grid", [](int64_t h, int64_t inter, int64_t sms, bool n_split) {
          if (h < 1 || inter < 1 || sms < 1 || h > (int64_t(1) << 20) || inter > (int64_t(1) << 24)) return 0;
          return MlpRowGrid(int(h), int(inter), int(std::min<int64_t>(sms, 4096)), n_split);
        },
        nb::arg("h"), nb::arg("inter"), nb::arg("sms"), nb::arg("n_split") = false,
        "The fused gated MLP's grid (ffi/kernels/gemv/mlp_row.h) for hidden size h and intermediate "
        "size inter on a GPU of `sms` SMs, for the K split or (n_split) the N split: its CTAs (all "
        "resident at once), 0 where the kernel does not take the shape.");
  m.def("gated_mlp_workspace", [](int64_t h, int64_t inter, int64_t grid, bool n_split) {
          return MlpRowWorkspaceElems(int(h), int(inter), int(grid), n_split);
        },
        nb::arg("h"), nb::arg("inter"), nb::arg("grid"), nb::arg("n_split"),
        "The fused gated MLP's workspace in f32 elements for a launch of `grid` CTAs.");
  m.def("out_mlp_grid", [](int64_t h, int64_t ho, int64_t inter, int64_t sms) {
          const int64_t limit = int64_t(1) << 24;
          if (h < 1 || ho < 1 || inter < 1 || sms < 1 || h >= limit || ho >= limit || inter >= limit) return 0;
          return RowChainGrid(OutMlpShapes(int(h), int(ho), int(inter)), int(std::min<int64_t>(sms, 4096)));
        },
        nb::arg("h"), nb::arg("ho"), nb::arg("inter"), nb::arg("sms"),
        "The grid of out_mlp (the attention's output projection [h, ho] and the gated MLP of hidden "
        "size h and intermediate size inter as one chain, ffi/kernels/gemv/row_chain.h) on a GPU of "
        "`sms` SMs: its CTAs (all resident at once), 0 where the kernel does not take the shapes.");
  m.def("out_mlp_workspace", [](int64_t h, int64_t inter) { return OutMlpWorkspaceElems(int(h), int(inter)); },
        nb::arg("h"), nb::arg("inter"), "out_mlp's workspace in f32 elements (o's output and h, as T).");
}

}  // namespace joa::gemv
