// Shared by the GEMV probes: time L dependent launches replayed as one CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

// launch(i, stream) issues launch i (0 .. L-1). child_graphs: each launch captured into its own
// graph and chained as child-graph nodes (how XLA's command buffers record FFI calls); else all L
// captured into one graph (kernel nodes; programmatic edges where a launch asks for PDL). Sets
// *us to the time per launch: the best of `rounds` timings of `reps` replays, after 5 warm-ups.
template <class Launch>
cudaError_t TimeGraphChain(int L, Launch&& launch, bool child_graphs, cudaStream_t s, int reps, int rounds,
                           float* us) {
  cudaError_t err = cudaSuccess;
#define JOA_PROBE_TRY(x)          \
  do {                            \
    err = (x);                    \
    if (err != cudaSuccess) return err; \
  } while (0)
  cudaGraph_t g;
  if (child_graphs) {
    JOA_PROBE_TRY(cudaGraphCreate(&g, 0));
    cudaGraphNode_t prev = nullptr;
    for (int i = 0; i < L; ++i) {
      cudaGraph_t child;
      JOA_PROBE_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      JOA_PROBE_TRY(launch(i, s));
      JOA_PROBE_TRY(cudaStreamEndCapture(s, &child));
      cudaGraphNode_t node;
      JOA_PROBE_TRY(cudaGraphAddChildGraphNode(&node, g, prev ? &prev : nullptr, prev ? 1 : 0, child));
      prev = node;
    }
  } else {
    JOA_PROBE_TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < L; ++i) JOA_PROBE_TRY(launch(i, s));
    JOA_PROBE_TRY(cudaStreamEndCapture(s, &g));
  }
  cudaGraphExec_t exec;
  JOA_PROBE_TRY(cudaGraphInstantiate(&exec, g, 0));
  for (int i = 0; i < 5; ++i) JOA_PROBE_TRY(cudaGraphLaunch(exec, s));
  cudaEvent_t a, b;
  JOA_PROBE_TRY(cudaEventCreate(&a));
  JOA_PROBE_TRY(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < rounds; ++r) {
    JOA_PROBE_TRY(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) JOA_PROBE_TRY(cudaGraphLaunch(exec, s));
    JOA_PROBE_TRY(cudaEventRecord(b, s));
    JOA_PROBE_TRY(cudaEventSynchronize(b));
    float ms = 0;
    JOA_PROBE_TRY(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms * 1e3f / float(reps * L));
  }
  *us = best;
  JOA_PROBE_TRY(cudaEventDestroy(a));
  JOA_PROBE_TRY(cudaEventDestroy(b));
  JOA_PROBE_TRY(cudaGraphExecDestroy(exec));
  JOA_PROBE_TRY(cudaGraphDestroy(g));
#undef JOA_PROBE_TRY
  return err;
}
