// Portable scalar SGD kernel: the reference every vector path must match bit
// for bit, the fallback on CPUs without AVX2, and the tail of the vector kernels.
#include "adam/ops_scalar.hpp"
#include "sgd/sgd_kernels.hpp"
#include "sgd/sgd_math.hpp"

namespace infinity::sgd {

void sgd_range_scalar(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    sgd_dispatch<adam::ScalarOps>(b, c, begin, end);
}

SgdRangeFn sgd_range_fn(adam::Isa isa) {
    switch (isa) {
#if defined(__x86_64__)
        case adam::Isa::kAvx512: return sgd_range_avx512;
        case adam::Isa::kAvx2: return sgd_range_avx2;
#endif
        default: return sgd_range_scalar;
    }
}

}  // namespace infinity::sgd
