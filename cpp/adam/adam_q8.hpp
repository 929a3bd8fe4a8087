// The Adam update over int8 moments (`optimizer_state_dtype="int8"`): each
// block of kQBlock elements decoded into L1 buffers, updated by adam_update,
// re-encoded with the block's new absmax (the codec: simd/q8_codec.hpp).
// Included by adam_dispatch.hpp, inside each per-ISA kernel's target region.
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_math.hpp"
#include "adam/adam_types.hpp"
#include "simd/q8_codec.hpp"

namespace infinity::adam::q8 {

using simd::q8::decode;
using simd::q8::encode;
using simd::q8::inverse_scale;
using simd::q8::kMax;
using simd::q8::load_lanes;
using simd::q8::Signed;
using simd::q8::store_lanes;
using simd::q8::Unsigned;

/// Updates the `len` (<= kQBlock) elements of one block starting at `i0`.
template <class Ops, class G, class O, bool kL2>
inline __attribute__((always_inline)) void q8_block(const AdamBuffers& b, const VecCoeffs<Ops>& k,
                                                    int64_t i0, int64_t len) {
    using V = typename Ops::V;
    using GS = typename G::Storage;
    constexpr int64_t W = Ops::kWidth;
    alignas(64) float m_f32[kQBlock];
    alignas(64) float v_f32[kQBlock];
    auto* const m_code = static_cast<uint8_t*>(b.exp_avg) + i0;
    auto* const v_code = static_cast<uint8_t*>(b.exp_avg_sq) + i0;
    const int64_t block = i0 / kQBlock;
    const V m_step = Ops::set1(b.exp_avg_scale[block] / kMax);
    const V v_step = Ops::set1(b.exp_avg_sq_scale[block] / kMax);
    alignas(64) uint8_t codes[W];
    // NOTE: padding lanes hold zeros (codes, parameters, gradients): their
    // moments stay zero through the update, so they cannot raise the maxima.
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        const V m = decode<Ops, Signed>(Ops::load_u8(load_lanes<Ops>(m_code + j, count, codes)), m_step);
        Ops::store(m_f32 + j, m);
        const V v = decode<Ops, Unsigned>(Ops::load_u8(load_lanes<Ops>(v_code + j, count, codes)), v_step);
        Ops::store(v_f32 + j, v);
    }
    const auto* const grad = static_cast<const GS*>(b.grad) + i0;
    float* const param = b.param + i0;
    alignas(64) float p_tmp[W];
    alignas(64) GS g_tmp[W];
    V m_max = Ops::set1(0.0f);
    V v_max = Ops::set1(0.0f);
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        V p = Ops::load(load_lanes<Ops>(param + j, count, p_tmp));
        V m = Ops::load(m_f32 + j);
        V v = Ops::load(v_f32 + j);
        adam_update<Ops, kL2>(p, Ops::template load_grad<G>(load_lanes<Ops>(grad + j, count, g_tmp)),
                              m, v, k);
        store_lanes<Ops>(param + j, count, [&](float* d) { Ops::store(d, p); });
        if constexpr (!std::is_same_v<O, NoOutTag>) {
            auto* const out = static_cast<typename O::Storage*>(b.out16) + i0 + j;
            store_lanes<Ops>(out, count, [&](uint16_t* d) { Ops::template store_out<O, false>(d, p); });
        }
        Ops::store(m_f32 + j, m);
        Ops::store(v_f32 + j, v);
        m_max = Ops::max(m_max, Ops::from_bits(Ops::iand(Ops::bits(m), Ops::iset1(0x7fffffff))));
        v_max = Ops::max(v_max, v);
    }
    const float m_absmax = Ops::hmax(m_max);
    const float v_absmax = Ops::hmax(v_max);
    b.exp_avg_scale[block] = m_absmax;
    b.exp_avg_sq_scale[block] = v_absmax;
    const V m_inv = Ops::set1(inverse_scale(m_absmax));
    const V v_inv = Ops::set1(inverse_scale(v_absmax));
    const typename Ops::I zero = Ops::iset1(0);
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        const typename Ops::I v = encode<Ops, Unsigned>(Ops::load(v_f32 + j), v_inv);
        // See NOTE [int8 second moment zero].
        const typename Ops::I m =
            Ops::lt_select(zero, v, encode<Ops, Signed>(Ops::load(m_f32 + j), m_inv), zero);
        store_lanes<Ops>(m_code + j, count, [&](uint8_t* d) { Ops::store_u8(d, m); });
        store_lanes<Ops>(v_code + j, count, [&](uint8_t* d) { Ops::store_u8(d, v); });
    }
}

/// Updates elements [begin, end) block by block; `begin` is a multiple of kQBlock.
template <class Ops, class G, class O, bool kL2>
inline __attribute__((always_inline)) int64_t q8_loop(const AdamBuffers& b, const AdamCoeffs& c,
                                                      int64_t begin, int64_t end) {
    const VecCoeffs<Ops> k(c);
    for (int64_t i = begin; i < end; i += kQBlock) {
        q8_block<Ops, G, O, kL2>(b, k, i, end - i < kQBlock ? end - i : kQBlock);
    }
    return end;
}

}  // namespace infinity::adam::q8
