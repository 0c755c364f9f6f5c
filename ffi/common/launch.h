// One way to launch a kernel from a handler: on XLA's stream (the execute stage), or, while a
// LaunchRecorder is active on this thread, as data that the record stage (ffi/record/) hands XLA as
// a command-buffer kernel node. A handler's code is the same for both: the plan, the checks and the
// parameters cannot drift apart.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace joa {

// A kernel launch as data.
struct RecordedLaunch {
  static constexpr size_t kMaxParamBytes = 512;  // one __grid_constant__ parameter struct
  const void* kernel = nullptr;                  // the host stub (cudaGetFuncBySymbol's symbol)
  dim3 grid, block;
  unsigned cluster = 1;  // CTAs a cluster along x; 1: none
  unsigned smem = 0;     // dynamic shared memory bytes
  bool pdl = false;      // a programmatic dependent launch (griddepcontrol.wait before its inputs)
  // The launch needs a function attribute a command-buffer node cannot carry (a shared-memory
  // carveout, a non-portable cluster size): the record stage falls back to stream capture.
  bool needs_function_attributes = false;
  alignas(16) unsigned char params[kMaxParamBytes];
  size_t params_size = 0;
};

// While one is active on a thread, Launch records instead of launching.
class LaunchRecorder {
 public:
  LaunchRecorder() : previous_(Active()) { Active() = this; }
  ~LaunchRecorder() { Active() = previous_; }
  LaunchRecorder(const LaunchRecorder&) = delete;
  LaunchRecorder& operator=(const LaunchRecorder&) = delete;

  static LaunchRecorder*& Active() {
    static thread_local LaunchRecorder* active = nullptr;
    return active;
  }
  const std::vector<RecordedLaunch>& launches() const { return launches_; }

  template <class Params>
  cudaError_t Add(const void* kernel, const cudaLaunchConfig_t& cfg, unsigned cluster, bool pdl,
                  bool needs_function_attributes, const Params& params) {
    static_assert(sizeof(Params) <= RecordedLaunch::kMaxParamBytes, "kernel parameters too large to record");
    RecordedLaunch l;
    l.kernel = kernel;
    l.grid = cfg.gridDim;
    l.block = cfg.blockDim;
    l.cluster = cluster;
    l.smem = unsigned(cfg.dynamicSmemBytes);
    l.pdl = pdl;
    l.needs_function_attributes = needs_function_attributes;
    std::memcpy(l.params, &params, sizeof(Params));
    l.params_size = sizeof(Params);
    launches_.push_back(l);
    return cudaSuccess;
  }

 private:
  LaunchRecorder* previous_;
  std::vector<RecordedLaunch> launches_;
};

}  // namespace joa
