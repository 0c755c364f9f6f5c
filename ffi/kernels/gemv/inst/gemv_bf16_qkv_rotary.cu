// The one-row kernels with the fused QKV epilogue (epilogue.cuh's QkvRotaryEpilogue) of one dtype per
// translation unit: dense weights (the dense row kernel) and 4-bit weights in the record layout.
#include "kernels/gemv/launch.cuh"

JOA_GEMV_INSTANTIATE_QKV_ROTARY(__nv_bfloat16)
