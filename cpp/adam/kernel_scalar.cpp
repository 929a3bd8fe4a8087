// Portable scalar kernel: the reference every vector path must match bit for
// bit, the fallback on CPUs without AVX2, and the tail of the vector kernels.
#include <cmath>
#include <cstring>

#include "adam/adam_dispatch.hpp"
#include "adam/convert.hpp"
#include "adam/kernels.hpp"
#include "adam/ops_scalar.hpp"

namespace infinity::adam {

void adam_range_scalar(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    adam_dispatch<ScalarOps>(b, c, begin, end);
}

void q8_encode_moments(const float* m, const float* v, uint8_t* m_code, float* m_scale,
                       uint8_t* v_code, float* v_scale, int64_t n) {
    for (int64_t i0 = 0; i0 < n; i0 += kQBlock) {
        const int64_t end = i0 + kQBlock < n ? i0 + kQBlock : n;
        float m_max = 0.0f;
        float v_max = 0.0f;
        for (int64_t i = i0; i < end; ++i) {
            m_max = ScalarOps::max(m_max, std::fabs(m[i]));
            v_max = ScalarOps::max(v_max, v[i]);
        }
        m_scale[i0 / kQBlock] = m_max;
        v_scale[i0 / kQBlock] = v_max;
        const float m_inv = q8::inverse_scale(m_max);
        const float v_inv = q8::inverse_scale(v_max);
        for (int64_t i = i0; i < end; ++i) {
            const uint32_t vc = q8::encode<ScalarOps, q8::Unsigned>(v[i], v_inv);
            // See NOTE [int8 second moment zero].
            v_code[i] = static_cast<uint8_t>(vc);
            m_code[i] = vc == 0 ? 0 : static_cast<uint8_t>(q8::encode<ScalarOps, q8::Signed>(m[i], m_inv));
        }
    }
}

void q8_decode(const uint8_t* code, const float* scale, float* out, int64_t n, bool is_signed) {
    for (int64_t i = 0; i < n; ++i) {
        const float step = scale[i / kQBlock] / q8::kMax;
        out[i] = is_signed ? q8::decode<ScalarOps, q8::Signed>(code[i], step)
                           : q8::decode<ScalarOps, q8::Unsigned>(code[i], step);
    }
}

}  // namespace infinity::adam
