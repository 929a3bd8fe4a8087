// Portable scalar kernel: the reference every vector path must match bit for
// bit, the fallback on CPUs without AVX2, and the tail of the vector kernels.
#include <cmath>
#include <cstring>

#include "adam/adam_dispatch.hpp"
#include "adam/convert.hpp"
#include "adam/kernels.hpp"

namespace infinity::adam {
namespace {

struct ScalarOps {
    using V = float;
    static constexpr int64_t kWidth = 1;

    static V set1(float x) { return x; }
    static V load(const float* p) { return *p; }
    static void store(float* p, V x) { *p = x; }
    static V add(V a, V b) { return a + b; }
    static V sub(V a, V b) { return a - b; }
    static V mul(V a, V b) { return a * b; }
    static V div(V a, V b) { return a / b; }
    static V sqrt(V a) { return std::sqrt(a); }
    // NOTE: std::fma is one correctly rounded operation, the same result as
    // the vector FMA instructions (glibc uses the FMA instruction if present).
    static V fma(V a, V b, V c) { return std::fma(a, b, c); }

    /// An optimisation barrier: the compiler may not fuse `x` into a later FMA.
    static V keep(V x) {
#if defined(__x86_64__) || defined(__i386__)
        __asm__("" : "+x"(x));
#elif defined(__aarch64__)
        __asm__("" : "+w"(x));
#else
        volatile float barrier = x;
        x = barrier;
#endif
        return x;
    }

    // Integer lanes for the int8 codec (q8_codec.hpp): uint32 arithmetic wraps.
    using I = uint32_t;
    static I bits(V x) { return float_bits(x); }
    static V from_bits(I u) { return bits_float(u); }
    static I iset1(uint32_t x) { return x; }
    static I iadd(I a, I b) { return a + b; }
    static I isub(I a, I b) { return a - b; }
    static I iand(I a, I b) { return a & b; }
    static I ior(I a, I b) { return a | b; }
    template <int k>
    static I shr(I a) { return a >> k; }
    template <int k>
    static I shl(I a) { return a << k; }
    /// (a < b as signed int32) ? x : y
    static I lt_select(I a, I b, I x, I y) {
        return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? x : y;
    }
    static I imin(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? a : b; }
    static V cvt(I a) { return static_cast<float>(static_cast<int32_t>(a)); }
    static V max(V a, V b) { return a < b ? b : a; }
    static float hmax(V a) { return a; }
    static I load_u8(const uint8_t* p) { return *p; }
    static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }

    template <class G>
    static V load_grad(const typename G::Storage* p) {
        if constexpr (std::is_same_v<G, F32Tag>) return *p;
        if constexpr (std::is_same_v<G, BF16Tag>) return bf16_to_float(*p);
        if constexpr (std::is_same_v<G, F16Tag>) return half_to_float(*p);
    }

    template <class O, bool /*kStream: no streaming stores in scalar code*/>
    static void store_out(uint16_t* p, V x) {
        if constexpr (std::is_same_v<O, BF16Tag>) *p = float_to_bf16(x);
        if constexpr (std::is_same_v<O, F16Tag>) *p = float_to_half(x);
    }
};

}  // namespace

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
