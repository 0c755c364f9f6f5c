// The probe's one kernel, compiled twice: into the probe library (the execute stage launches it on
// XLA's stream) and alone into an sm_90a cubin (the record stage hands those bytes to XLA, which
// loads them and adds a kernel node). extern "C": the record stage names the kernel by symbol.
#pragma once

struct StreamParams {
  const float4* w;      // the "weights": read once, independent of the previous call
  long long n_vec;      // float4s in w
  const float* x_in;    // the previous call's output: read only after griddepcontrol.wait
  float* x_out;         // gridDim.x * blockDim.x floats
  int wait_first;       // 1: wait before reading w (no overlap); 0: stream w, then wait
};

// Each thread sums its grid-stride share of w, then adds x_in[0]: a GEMV's memory pattern (a weight
// stream that does not depend on the previous kernel, a small input that does) without its math.
extern "C" __global__ void __launch_bounds__(256) joa_probe_stream(const StreamParams p) {
  if (p.wait_first) asm volatile("griddepcontrol.wait;" ::: "memory");
  // Let the next kernel's CTAs be scheduled as ours retire (it waits before reading x_out).
  asm volatile("griddepcontrol.launch_dependents;");
  float acc = 0.f;
  const long long stride = (long long)gridDim.x * blockDim.x;
#pragma unroll 4
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n_vec; i += stride) {
    const float4 v = __ldg(p.w + i);
    acc += (v.x + v.y) + (v.z + v.w);
  }
  if (!p.wait_first) asm volatile("griddepcontrol.wait;" ::: "memory");
  p.x_out[blockIdx.x * blockDim.x + threadIdx.x] = acc * 1e-6f + p.x_in[0];
}
