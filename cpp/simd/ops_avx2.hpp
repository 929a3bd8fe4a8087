// The AVX2 "Ops" backend of the CPU optimizer kernels (8 floats per
// vector): every optimizer's AVX2 kernel (kernels_avx2.cpp) runs over it.
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

struct Avx2Ops {
    using V = __m256;
    static constexpr int64_t kWidth = 8;

    static V set1(float x) { return _mm256_set1_ps(x); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V sqrt(V a) { return _mm256_sqrt_ps(a); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V keep(V x) {
        __asm__("" : "+x"(x));
        return x;
    }
    /// Orders the streaming stores of store_out<O, true> before later stores.
    static void stream_fence() { _mm_sfence(); }

    // Integer lanes for the int8 codec (q8_codec.hpp).
    using I = __m256i;
    static I bits(V x) { return _mm256_castps_si256(x); }
    static V from_bits(I u) { return _mm256_castsi256_ps(u); }
    static I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
    static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
    static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
    static I iand(I a, I b) { return _mm256_and_si256(a, b); }
    static I ior(I a, I b) { return _mm256_or_si256(a, b); }
    static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
    static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
    static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
    template <int k>
    static I shr(I a) { return _mm256_srli_epi32(a, k); }
    template <int k>
    static I shl(I a) { return _mm256_slli_epi32(a, k); }
    static I lt_select(I a, I b, I x, I y) { return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(b, a)); }
    static I imin(I a, I b) { return _mm256_min_epi32(a, b); }
    static V cvt(I a) { return _mm256_cvtepi32_ps(a); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static float hmax(V a) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        return _mm_cvtss_f32(m);
    }
    static I load_u8(const uint8_t* p) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    }
    static void store_u8(uint8_t* p, I x) {
        // The low byte of each 32-bit lane, gathered into the low 4 bytes of each half.
        const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                              -1, -1, -1, -1);
        const __m256i b = _mm256_shuffle_epi8(x, pick);
        const __m128i lo = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(p), lo);
    }

    /// Stores the low 16 bits of each lane; every lane must be <= 0xffff.
    static void store_u16(uint16_t* p, I x) {
        // The unsigned saturating pack is exact for lanes <= 0xffff.
        const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    }

    template <class G>
    static V load_grad(const typename G::Storage* p) {
        if constexpr (std::is_same_v<G, F32Tag>) {
            return _mm256_loadu_ps(p);
        } else {
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
            if constexpr (std::is_same_v<G, BF16Tag>) {
                return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                return _mm256_cvtph_ps(h);
            }
        }
    }

    template <class O, bool kStream>
    static void store_out(uint16_t* p, V x) {
        __m128i h;
        if constexpr (std::is_same_v<O, BF16Tag>) {
            const __m256i u = _mm256_castps_si256(x);
            const __m256i hi = _mm256_srli_epi32(u, 16);
            const __m256i bias =
                _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
            const __m256i quiet_nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
            const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
            r = _mm256_blendv_epi8(r, quiet_nan, _mm256_castps_si256(is_nan));
            // Every lane is <= 0xffff, so the unsigned saturating pack is exact.
            h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        } else {
            h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        }
        if constexpr (kStream) {
            _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);  // aligned: see stream_out()
        } else {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
        }
    }
};

}  // namespace
}  // namespace infinity::simd
