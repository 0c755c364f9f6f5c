// One (dtype, head dim) of the decode engine per translation unit: parallel builds.
#include "kernels/decode/launch.cuh"

JOA_DECODE_INSTANTIATE(__nv_bfloat16, 64)
