// Entry points of the per-ISA kernels, one translation unit each.
#pragma once

#include <cstdint>

#include "adam/adam_types.hpp"

namespace infinity::adam {

/// Updates elements [begin, end) of `b`. Every ISA gives the same bits.
using RangeFn = void (*)(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);

void adam_range_scalar(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void adam_range_avx2(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
void adam_range_avx512(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
#endif

}  // namespace infinity::adam
