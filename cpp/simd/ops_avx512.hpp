// The AVX512 "Ops" backend of the CPU optimizer kernels (16 floats per
// vector): every optimizer's AVX-512 kernel (kernels_avx512.cpp) runs over it.
//
// NOTE: include it only inside the target region of a per-ISA translation
// unit (see kernels_avx2.cpp): its intrinsics need the target's features. In an
// unnamed namespace (see ops_scalar.hpp) so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "simd/tags.hpp"

namespace infinity::simd {
namespace {

struct Avx512Ops {
    using V = __m512;
    static constexpr int64_t kWidth = 16;

    static V set1(float x) { return _mm512_set1_ps(x); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V sqrt(V a) { return _mm512_sqrt_ps(a); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V keep(V x) {
        __asm__("" : "+v"(x));
        return x;
    }
    /// Orders the streaming stores of store_out<O, true> before later stores.
    static void stream_fence() { _mm_sfence(); }

    // Integer lanes for the int8 codec (q8_codec.hpp).
    using I = __m512i;
    static I bits(V x) { return _mm512_castps_si512(x); }
    static V from_bits(I u) { return _mm512_castsi512_ps(u); }
    static I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
    static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
    static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
    static I iand(I a, I b) { return _mm512_and_si512(a, b); }
    static I ior(I a, I b) { return _mm512_or_si512(a, b); }
    static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
    static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
    static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
    template <int k>
    static I shr(I a) { return _mm512_srli_epi32(a, k); }
    template <int k>
    static I shl(I a) { return _mm512_slli_epi32(a, k); }
    static I lt_select(I a, I b, I x, I y) {
        return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, b), y, x);
    }
    static I imin(I a, I b) { return _mm512_min_epi32(a, b); }
    static V cvt(I a) { return _mm512_cvtepi32_ps(a); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static float hmax(V a) {
        __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        return _mm_cvtss_f32(m);
    }
    static I load_u8(const uint8_t* p) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static void store_u8(uint8_t* p, I x) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
    }

    /// Stores the low 16 bits of each lane (the truncating 32->16 narrowing).
    static void store_u16(uint16_t* p, I x) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
    }

    template <class G>
    static V load_grad(const typename G::Storage* p) {
        if constexpr (std::is_same_v<G, F32Tag>) {
            return _mm512_loadu_ps(p);
        } else {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
            if constexpr (std::is_same_v<G, BF16Tag>) {
                return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            } else {
                return _mm512_cvtph_ps(h);
            }
        }
    }

    template <class O, bool kStream>
    static void store_out(uint16_t* p, V x) {
        __m256i h;
        if constexpr (std::is_same_v<O, BF16Tag>) {
            const __m512i u = _mm512_castps_si512(x);
            const __m512i hi = _mm512_srli_epi32(u, 16);
            const __m512i bias =
                _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
            const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
            const __m512i quiet_nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
            const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            // Every lane is <= 0xffff, so the truncating 32->16 narrowing is exact.
            h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, r, quiet_nan));
        } else {
            h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        }
        if constexpr (kStream) {
            _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);  // aligned: see stream_out()
        } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
        }
    }
};

}  // namespace
}  // namespace infinity::simd
