// The slots kernel on the record layout of one dtype per translation unit (4-bit weights, one row
// of x: slots.cuh's RecordFormat).
#include "kernels/gemv/launch.cuh"

JOA_GEMV_INSTANTIATE_RECORD(__half)
