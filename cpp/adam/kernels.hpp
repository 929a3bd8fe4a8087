// Entry points of the per-ISA Adam kernels (defined in cpp/simd/kernels_<isa>.cpp,
// one translation unit per ISA for every optimizer) and the run-time choice
// among them (the ISA of simd/isa.hpp, the one every optimizer uses).
#pragma once

#include <cstdint>

#include "adam/adam_types.hpp"
#include "simd/isa.hpp"

namespace infinity::adam {

/// Updates elements [begin, end) of `b`. Every ISA gives the same bits.
using RangeFn = void (*)(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);

void adam_range_scalar(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void adam_range_avx2(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
void adam_range_avx512(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
#endif

/// The kernel entry point of `isa`.
RangeFn adam_range_fn(simd::Isa isa);

/// Encodes fp32 moments into int8 storage (simd/q8_codec.hpp), block by block
/// from element 0, as the kernel stores them: for state dicts and tests.
void q8_encode_moments(const float* m, const float* v, uint8_t* m_code, float* m_scale,
                       uint8_t* v_code, float* v_scale, int64_t n);
/// Decodes int8 storage of one moment (signed: exp_avg) into fp32.
void q8_decode(const uint8_t* code, const float* scale, float* out, int64_t n, bool is_signed);

}  // namespace infinity::adam
