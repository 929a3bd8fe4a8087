// Memory-bandwidth probes (the roofline of `infinity bench optim`), bound as
// `_C.adam.bandwidth_probe`.
#pragma once

#include <cstdint>

namespace infinity::simd {

enum class BandwidthKernel : int {
    kTriad = 0,       ///< a = b + s*c          (STREAM triad: 2 reads, 1 write)
    kAxpy = 1,        ///< a += s*b             (2 reads, 1 write back in place)
    kAdamPattern = 2,  ///< p += g; m += g; v += g (Adam's 4 reads and 3 writes, no math)
    kAdamPatternPrefetch = 3  ///< the same with software prefetch, as the Adam kernel does
};

/// Runs one pass of `kind` over n floats on the compute pool; returns the
/// bytes it moves by the STREAM convention (each array element read or
/// written once counts, write-allocate traffic does not).
int64_t bandwidth_probe(BandwidthKernel kind, float* a, float* b, float* c, float* d, int64_t n);

}  // namespace infinity::simd
