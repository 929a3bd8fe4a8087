// Entry points of the per-ISA SGD kernels (defined in cpp/simd/kernels_<isa>.cpp,
// one translation unit per ISA for every optimizer) and the run-time choice
// among them (the ISA of simd/isa.hpp, the one every optimizer uses).
#pragma once

#include <cstdint>

#include "sgd/sgd_types.hpp"
#include "simd/isa.hpp"

namespace infinity::sgd {

/// Updates elements [begin, end) of `b`. Every ISA gives the same bits.
using SgdRangeFn = void (*)(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);

void sgd_range_scalar(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void sgd_range_avx2(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
void sgd_range_avx512(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
#endif

/// The kernel entry point of `isa`.
SgdRangeFn sgd_range_fn(simd::Isa isa);

/// Validates `b` and `h` (throws std::invalid_argument), then updates all
/// `b.n` elements with the active ISA on the compute pool (every optimizer's
/// pool and task split: simd/flat_step.hpp). The result is bitwise independent of the thread
/// count and of the ISA.
void sgd_step(const SgdBuffers& b, const SgdHyper& h);

}  // namespace infinity::sgd
