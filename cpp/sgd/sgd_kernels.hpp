// Entry points of the per-ISA SGD kernels, one translation unit each, and the
// run-time choice among them (the ISA the Adam kernels use: adam/isa.hpp, so
// forcing one forces all).
#pragma once

#include <cstdint>

#include "adam/isa.hpp"
#include "sgd/sgd_types.hpp"

namespace infinity::sgd {

/// Updates elements [begin, end) of `b`. Every ISA gives the same bits.
using SgdRangeFn = void (*)(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);

void sgd_range_scalar(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
#if defined(__x86_64__)
void sgd_range_avx2(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
void sgd_range_avx512(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end);
#endif

/// The kernel entry point of `isa`.
SgdRangeFn sgd_range_fn(adam::Isa isa);

/// Validates `b` and `h` (throws std::invalid_argument), then updates all
/// `b.n` elements with the active ISA on the compute pool (the Adam kernels'
/// pool and task split). The result is bitwise independent of the thread
/// count and of the ISA.
void sgd_step(const SgdBuffers& b, const SgdHyper& h);

}  // namespace infinity::sgd
