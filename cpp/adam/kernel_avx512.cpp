// AVX-512 kernel (F + BW + VL): 16 floats per vector. Chosen at run time only
// on CPUs that report the three features (see isa.cpp).
#include "adam/kernels.hpp"

#if defined(__x86_64__)

// NOTE: GCC 12 warns "'__Y' may be used uninitialized" inside its own
// avx512fintrin.h (the _mm512_undefined_* idiom, GCC bug 105593, fixed in 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "adam/adam_types.hpp"

#include "common/target_avx512_begin.hpp"  // the region ends at target_end.hpp

#include "adam/adam_dispatch.hpp"
#include "adam/ops_avx512.hpp"

namespace infinity::adam {

void adam_range_avx512(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    const int64_t done = adam_dispatch<Avx512Ops>(b, c, begin, end);
    // NOTE: streaming stores are weakly ordered; fence them before the task
    // reports completion to the thread that will read the output.
    _mm_sfence();
    if (done < end) adam_range_scalar(b, c, done, end);
}

}  // namespace infinity::adam

#include "common/target_end.hpp"

#endif  // __x86_64__
