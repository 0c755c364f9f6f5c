// One (dtype, weight format) of the GEMV engine per translation unit: parallel builds.
#include "kernels/gemv/launch.cuh"

JOA_GEMV_INSTANTIATE(__nv_bfloat16, 8, false)
