// AVX2 Lion kernel (8 floats per vector), chosen at run time only on CPUs that
// report the features (see adam/isa.cpp).
#include "lion/lion_kernels.hpp"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "common/target_avx2_begin.hpp"  // the region ends at target_end.hpp

#include "adam/ops_avx2.hpp"
#include "lion/lion_math.hpp"

namespace infinity::lion {

void lion_range_avx2(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end) {
    const int64_t done = lion_dispatch<adam::Avx2Ops>(b, c, begin, end);
    if (done < end) lion_range_scalar(b, c, done, end);
}

}  // namespace infinity::lion

#include "common/target_end.hpp"

#endif  // __x86_64__
