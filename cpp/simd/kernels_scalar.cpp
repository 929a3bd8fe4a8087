// The portable scalar kernels of every optimizer (Adam, Lion, SGD): the
// reference every vector kernel must match bit for bit, the fallback on CPUs
// without AVX2, and the tail of the vector kernels (kernels_avx2.cpp,
// kernels_avx512.cpp). Also the int8 state conversions for state dicts, which
// run over the same scalar backend.
#include <cmath>
#include <cstdint>

#include "adam/adam_dispatch.hpp"
#include "adam/kernels.hpp"
#include "lion/lion_kernels.hpp"
#include "lion/lion_math.hpp"
#include "sgd/sgd_kernels.hpp"
#include "sgd/sgd_math.hpp"
#include "simd/ops_scalar.hpp"
#include "simd/q8_codec.hpp"

namespace infinity {

using simd::ScalarOps;

namespace {

/// Encodes `n` fp32 values into codes of format F and one scale per block of
/// kQBlock elements (the block's absmax; Unsigned: its max), block by block
/// from element 0, as the kernels store a state.
template <class F>
void encode_blocks(const float* values, uint8_t* code, float* scale, int64_t n) {
    namespace q8 = simd::q8;
    constexpr int64_t kQBlock = simd::kQBlock;
    for (int64_t i0 = 0; i0 < n; i0 += kQBlock) {
        const int64_t end = i0 + kQBlock < n ? i0 + kQBlock : n;
        float max = 0.0f;
        for (int64_t i = i0; i < end; ++i) {
            max = ScalarOps::max(max, F::kSigned ? std::fabs(values[i]) : values[i]);
        }
        scale[i0 / kQBlock] = max;
        const float inv = q8::inverse_scale(max);
        for (int64_t i = i0; i < end; ++i) {
            code[i] = static_cast<uint8_t>(q8::encode<ScalarOps, F>(values[i], inv));
        }
    }
}

}  // namespace

namespace adam {

void adam_range_scalar(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    adam_range<ScalarOps>(b, c, begin, end);
}

void q8_encode_moments(const float* m, const float* v, uint8_t* m_code, float* m_scale,
                       uint8_t* v_code, float* v_scale, int64_t n) {
    encode_blocks<q8::Signed>(m, m_code, m_scale, n);
    encode_blocks<q8::Unsigned>(v, v_code, v_scale, n);
    // See NOTE [int8 second moment zero].
    for (int64_t i = 0; i < n; ++i) {
        if (v_code[i] == 0) m_code[i] = 0;
    }
}

void q8_decode(const uint8_t* code, const float* scale, float* out, int64_t n, bool is_signed) {
    for (int64_t i = 0; i < n; ++i) {
        const float step = scale[i / kQBlock] / q8::kMax;
        out[i] = is_signed ? q8::decode<ScalarOps, q8::Signed>(code[i], step)
                           : q8::decode<ScalarOps, q8::Unsigned>(code[i], step);
    }
}

}  // namespace adam

namespace lion {

void lion_range_scalar(const LionBuffers& b, const LionCoeffs& c, int64_t begin, int64_t end) {
    lion_range<ScalarOps>(b, c, begin, end);
}

void q8_encode_signed(const float* values, uint8_t* code, float* scale, int64_t n) {
    encode_blocks<simd::q8::Signed>(values, code, scale, n);
}

}  // namespace lion

namespace sgd {

void sgd_range_scalar(const SgdBuffers& b, const SgdCoeffs& c, int64_t begin, int64_t end) {
    sgd_range<ScalarOps>(b, c, begin, end);
}

}  // namespace sgd
}  // namespace infinity
