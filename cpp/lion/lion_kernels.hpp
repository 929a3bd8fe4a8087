// Entry points of the per-ISA Lion kernels (defined in cpp/simd/kernels_<isa>.cpp,
// one translation unit per ISA for every optimizer) and the run-time choice
// among them (the ISA of simd/isa.hpp, the one every optimizer uses).
#pragma once

#include <cstdint>

#include "lion/lion_types.hpp"
#include "simd/isa.hpp"

namespace infinity::lion {

/// Updates elements [begin, end) of `b`. Every ISA gives the same bits.
using LionRangeFn = void (*)(const LionBuffers& b, const LionCoeffs& c, int64_t begin,
                             int64_t end);

void lion_range_scalar(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void lion_range_avx2(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end);
void lion_range_avx512(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end);
#endif

/// The kernel entry point of `isa`.
LionRangeFn lion_range_fn(simd::Isa isa);

/// Encodes fp32 values into the signed int8 codes and block scales the kernel
/// stores the momentum in, block by block from element 0: for state dicts.
void q8_encode_signed(const float* values, uint8_t* code, float* scale, int64_t n);

}  // namespace infinity::lion
