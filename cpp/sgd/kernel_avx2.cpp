// AVX2 SGD kernel (8 floats per vector), chosen at run time only on CPUs that
// report the features (see adam/isa.cpp).
#include "sgd/sgd_kernels.hpp"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "common/target_avx2_begin.hpp"  // the region ends at target_end.hpp

#include "adam/ops_avx2.hpp"
#include "sgd/sgd_math.hpp"

namespace infinity::sgd {

void sgd_range_avx2(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    const int64_t done = sgd_dispatch<adam::Avx2Ops>(b, c, begin, end);
    if (done < end) sgd_range_scalar(b, c, done, end);
}

}  // namespace infinity::sgd

#include "common/target_end.hpp"

#endif  // __x86_64__
