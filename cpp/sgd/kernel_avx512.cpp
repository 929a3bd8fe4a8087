// AVX512 SGD kernel (16 floats per vector), chosen at run time only on CPUs that
// report the features (see adam/isa.cpp).
#include "sgd/sgd_kernels.hpp"

#if defined(__x86_64__)

// NOTE: GCC 12 warns inside its own avx512fintrin.h (see adam/kernel_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstdint>

// NOTE: a target region, as in adam/kernel_avx2.cpp: the backend and the
// templates of sgd_math.hpp must be included inside it and nowhere before.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif

#include "adam/ops_avx512.hpp"
#include "sgd/sgd_math.hpp"

namespace infinity::sgd {

void sgd_range_avx512(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    const int64_t done = sgd_dispatch<adam::Avx512Ops>(b, c, begin, end);
    if (done < end) sgd_range_scalar(b, c, done, end);
}

}  // namespace infinity::sgd

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__
