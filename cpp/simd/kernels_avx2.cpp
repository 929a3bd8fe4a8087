// The AVX2 + FMA + F16C kernels of every optimizer (Adam, Lion, SGD), 8 floats
// per vector. Chosen at run time only on CPUs that report all three features
// (isa.cpp); each leaves a tensor's tail to its scalar kernel (kernels_scalar.cpp).
#include "adam/kernels.hpp"
#include "lion/lion_kernels.hpp"
#include "sgd/sgd_kernels.hpp"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "common/target_avx2_begin.hpp"  // the region ends at target_end.hpp

#include "adam/adam_dispatch.hpp"
#include "lion/lion_math.hpp"
#include "sgd/sgd_math.hpp"
#include "simd/ops_avx2.hpp"

namespace infinity {

using simd::Avx2Ops;

void adam::adam_range_avx2(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    adam_range<Avx2Ops>(b, c, begin, end);
}

void lion::lion_range_avx2(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end) {
    lion_range<Avx2Ops>(b, c, begin, end);
}

void sgd::sgd_range_avx2(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    sgd_range<Avx2Ops>(b, c, begin, end);
}

}  // namespace infinity

#include "common/target_end.hpp"

#endif  // __x86_64__
