// One (dtype, head dim, cache format) of the decode engine per translation unit: parallel builds.
#include "kernels/decode/launch.cuh"

JOA_DECODE_INSTANTIATE_KV(__nv_bfloat16, 96, kInt8)
