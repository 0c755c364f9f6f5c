// The cubin the record stage loads: nvcc -cubin -gencode arch=compute_90a,code=sm_90a
#include "stream_kernel.cuh"
