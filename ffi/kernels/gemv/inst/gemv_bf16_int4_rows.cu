// The rows kernel of one dtype per translation unit (4-bit weights in the rows layout: rows.cuh).
#include "kernels/gemv/launch.cuh"

JOA_GEMV_INSTANTIATE_ROWS(__nv_bfloat16)
