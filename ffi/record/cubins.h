// The sm_90a cubins of the kernels the record stage hands XLA (XLA loads a kernel from its image
// and its name, not from our module's function). CMake compiles the listed instantiation sources a
// second time with -cubin and embeds them (cmake/record_cubins.cmake writes the table).
#pragma once

#include <cstddef>

namespace joa::record {

struct CubinImage {
  const char* source;  // the instantiation source it was compiled from
  const unsigned char* begin;
  const unsigned char* end;
};

extern const CubinImage kCubins[];
extern const size_t kNumCubins;

}  // namespace joa::record
