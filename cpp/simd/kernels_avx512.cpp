// The AVX-512 (F + BW + VL) kernels of every optimizer (Adam, Lion, SGD), 16
// floats per vector. Chosen at run time only on CPUs that report the three
// features (isa.cpp); each leaves a tensor's tail to its scalar kernel
// (kernels_scalar.cpp).
#include "adam/kernels.hpp"
#include "lion/lion_kernels.hpp"
#include "sgd/sgd_kernels.hpp"

#if defined(__x86_64__)

// NOTE: GCC 12 warns "'__Y' may be used uninitialized" inside its own
// avx512fintrin.h (the _mm512_undefined_* idiom, GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstdint>

#include "common/target_avx512_begin.hpp"  // the region ends at target_end.hpp

#include "adam/adam_dispatch.hpp"
#include "lion/lion_math.hpp"
#include "sgd/sgd_math.hpp"
#include "simd/ops_avx512.hpp"

namespace infinity {

using simd::Avx512Ops;

void adam::adam_range_avx512(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin,
                             int64_t end) {
    adam_range<Avx512Ops>(b, c, begin, end);
}

void lion::lion_range_avx512(const LionBuffers& b, const LionCoeffs& c, int64_t begin,
                             int64_t end) {
    lion_range<Avx512Ops>(b, c, begin, end);
}

void sgd::sgd_range_avx512(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    sgd_range<Avx512Ops>(b, c, begin, end);
}

}  // namespace infinity

#include "common/target_end.hpp"

#endif  // __x86_64__
