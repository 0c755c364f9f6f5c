// The current device's compute capability: a device property, the same on every call, so a plan or
// a launch rule that reads it stays a function of static shapes on a given GPU. No stream work.
#pragma once

#include <cuda_runtime.h>

namespace joa {

struct ComputeCapability {
  int major = 0, minor = 0;  // 0.0 when the device cannot be queried
};

inline ComputeCapability CurrentComputeCapability() {
  ComputeCapability cc;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&cc.major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&cc.minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return {};
  }
  return cc;
}

// The current device's SMs (the prefill engine's persistent grid), 0 when it cannot be queried: a
// device attribute like the above, not stream work, so it may run while XLA captures the stream.
inline int CurrentSmCount() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 0;
  }
  return n;
}

}  // namespace joa
