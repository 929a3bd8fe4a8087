// AVX2 + FMA + F16C kernel: 8 floats per vector. Chosen at run time only on
// CPUs that report all three features (see isa.cpp).
#include "adam/kernels.hpp"

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "adam/adam_types.hpp"

#include "common/target_avx2_begin.hpp"  // the region ends at target_end.hpp

#include "adam/adam_dispatch.hpp"
#include "adam/ops_avx2.hpp"

namespace infinity::adam {

void adam_range_avx2(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    const int64_t done = adam_dispatch<Avx2Ops>(b, c, begin, end);
    // NOTE: streaming stores are weakly ordered; fence them before the task
    // reports completion to the thread that will read the output.
    _mm_sfence();
    if (done < end) adam_range_scalar(b, c, done, end);
}

}  // namespace infinity::adam

#include "common/target_end.hpp"

#endif  // __x86_64__
