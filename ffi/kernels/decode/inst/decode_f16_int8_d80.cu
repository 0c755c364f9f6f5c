// One (dtype, head dim, cache format) of the decode engine per translation unit: parallel builds.
#include "kernels/decode/launch.cuh"

JOA_DECODE_INSTANTIATE_KV(__half, 80, kInt8)
