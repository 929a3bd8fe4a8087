// Portable scalar Lion kernel: the reference every vector path must match bit
// for bit, the fallback on CPUs without AVX2, and the tail of the vector kernels.
#include "adam/ops_scalar.hpp"
#include "lion/lion_kernels.hpp"
#include "lion/lion_math.hpp"

namespace infinity::lion {

void lion_range_scalar(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end) {
    lion_dispatch<adam::ScalarOps>(b, c, begin, end);
}

void q8_encode_signed(const float* values, uint8_t* code, float* scale, int64_t n) {
    using Ops = adam::ScalarOps;
    for (int64_t i0 = 0; i0 < n; i0 += kQBlock) {
        const int64_t end = i0 + kQBlock < n ? i0 + kQBlock : n;
        float absmax = 0.0f;
        for (int64_t i = i0; i < end; ++i) absmax = Ops::max(absmax, std::fabs(values[i]));
        scale[i0 / kQBlock] = absmax;
        const float inv = adam::q8::inverse_scale(absmax);
        for (int64_t i = i0; i < end; ++i) {
            code[i] = static_cast<uint8_t>(adam::q8::encode<Ops, adam::q8::Signed>(values[i], inv));
        }
    }
}

LionRangeFn lion_range_fn(adam::Isa isa) {
    switch (isa) {
#if defined(__x86_64__)
        case adam::Isa::kAvx512: return lion_range_avx512;
        case adam::Isa::kAvx2: return lion_range_avx2;
#endif
        default: return lion_range_scalar;
    }
}

}  // namespace infinity::lion
