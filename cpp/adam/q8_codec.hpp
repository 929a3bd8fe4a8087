// 8-bit block-wise storage of the Adam moments (`optimizer_state_dtype="int8"`),
// decoded and re-encoded inside the fused kernel. Written once over an "Ops"
// backend (scalar, AVX2, AVX-512) like adam_math.hpp, so every ISA stores the
// same bytes.
//
// The idea is 8-bit Adam's (Dettmers et al., 2022): block-wise *dynamic*
// quantisation, every block of kQBlock elements normalised by its own absmax
// (kept in fp32), each element an 8-bit code with an exponent and a linear
// fraction, signed for the first moment and unsigned for the second. Instead
// of the paper's variable-length exponent (a 256-entry codebook searched per
// element) the codes here are fixed-width minifloats, so the vector kernels
// encode with a few integer operations and no table:
//   exp_avg     sign + 4-bit exponent + 3-bit fraction (bias 15): |m| / absmax
//               from 1 down to 2^-17 / 1.875 (4e-6), at most 1/16 relative error;
//   exp_avg_sq  5-bit exponent + 3-bit fraction (bias 31), no sign: down to
//               2^-33 / 1.875 (6e-11), so sqrt(v) reaches as far below its block
//               maximum as |m| does below its own.
// Both map the block's largest value to the largest code, 1.875 (= 2^0 * 1.111b),
// and keep subnormals (a linear step below 2^(1-bias)).
//
// Codes round to nearest, ties to even. bf16 moments round stochastically
// instead (see NOTE [bf16 stochastic rounding]): beta2 = 0.999 decays the second
// moment by 0.1% a step, less than half a step of either format, so under
// nearest rounding a decay never survives the store and v only ratchets up.
// For bf16 that cost loss in issue 26's grid; for int8 the bias is bounded
// (v settles ~21% above its EMA, steps ~3.5% smaller) and int8 meets the loss
// goal in every cell, so the codes keep the cheaper nearest rounding. The
// counter-based random bits of stochastic_round.hpp would serve here as well.
//
// See NOTE [int8 second moment zero] (an element whose second moment codes to
// zero loses its first moment too) and NOTE [int8 block size] (why 256, and
// why tensors start on a block), docs/NOTES.md.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam/adam_math.hpp"
#include "adam/adam_types.hpp"
#include "adam/convert.hpp"

namespace infinity::adam::q8 {

/// The value of the largest code: a block's absmax maps to it.
inline constexpr float kMax = 1.875f;

/// Code format of the first moment: sign bit, 4-bit exponent, 3-bit fraction.
struct Signed {
    static constexpr uint32_t kBias = 15;
    static constexpr uint32_t kMaxCode = 127;  ///< of the magnitude (7 bits)
    static constexpr bool kSigned = true;
};
/// Code format of the second moment: 5-bit exponent, 3-bit fraction.
struct Unsigned {
    static constexpr uint32_t kBias = 31;
    static constexpr uint32_t kMaxCode = 255;
    static constexpr bool kSigned = false;
};

/// fp32 bit patterns the codec is built from (F: one of the code formats).
template <class F>
struct Consts {
    static constexpr uint32_t kFraction = 3;                    // fraction bits
    static constexpr uint32_t kDrop = 23 - kFraction;           // fp32 mantissa bits dropped
    static constexpr uint32_t kMinNormal = (128 - F::kBias) << 23;  // 2^(1-bias)
    static constexpr uint32_t kMagic = (148 - F::kBias) << 23;  // 2^(21-bias): ulp = subnormal step
    static constexpr uint32_t kSubStep = (125 - F::kBias) << 23;  // 2^(-2-bias): subnormal step
    static constexpr uint32_t kOffset = (127 - F::kBias) << kFraction;  // exponent re-bias, in code units
};

/// 1 / step of a block: multiplies a value into code units; 0 for an all-zero
/// (or all-subnormal, or non-finite) block, which then encodes as zeros.
inline float inverse_scale(float absmax) { return absmax >= 1.17549435e-38f ? kMax / absmax : 0.0f; }

/// Codes (one per 32-bit lane, 0..255) of the values `x` times `inv`.
template <class Ops, class F>
inline __attribute__((always_inline)) typename Ops::I encode(typename Ops::V x, typename Ops::V inv) {
    using C = Consts<F>;
    using I = typename Ops::I;
    const I xb = Ops::bits(x);
    // NOTE: keep() stops the product from being fused with the add below.
    const typename Ops::V y =
        Ops::keep(Ops::mul(Ops::from_bits(Ops::iand(xb, Ops::iset1(0x7fffffff))), inv));
    const I u = Ops::bits(y);
    // Normal range: round the fp32 mantissa to 3 bits (to nearest, ties to even;
    // a carry moves to the next exponent), then re-bias the exponent.
    const I lsb = Ops::iand(Ops::template shr<C::kDrop>(u), Ops::iset1(1));
    const I rounded = Ops::iadd(u, Ops::iadd(Ops::iset1((1u << (C::kDrop - 1)) - 1), lsb));
    const I normal = Ops::isub(Ops::template shr<C::kDrop>(rounded), Ops::iset1(C::kOffset));
    // Subnormal range: adding 2^(21-bias) rounds y to a multiple of the step.
    const typename Ops::V magic = Ops::set1(bits_float(C::kMagic));
    const I sub = Ops::isub(Ops::bits(Ops::add(y, magic)), Ops::iset1(C::kMagic));
    I code = Ops::lt_select(u, Ops::iset1(C::kMinNormal), sub, normal);
    code = Ops::imin(code, Ops::iset1(F::kMaxCode));
    if constexpr (F::kSigned) {
        code = Ops::ior(code, Ops::template shr<24>(Ops::iand(xb, Ops::iset1(0x80000000u))));
    }
    return code;
}

/// The values of `code` (one per 32-bit lane) times `step` (= absmax / kMax).
template <class Ops, class F>
inline __attribute__((always_inline)) typename Ops::V decode(typename Ops::I code,
                                                             typename Ops::V step) {
    using C = Consts<F>;
    using I = typename Ops::I;
    const I mag = F::kSigned ? Ops::iand(code, Ops::iset1(0x7f)) : code;
    const I normal = Ops::iadd(Ops::template shl<C::kDrop>(mag), Ops::iset1(C::kOffset << C::kDrop));
    const I sub = Ops::bits(
        Ops::mul(Ops::cvt(mag), Ops::set1(bits_float(C::kSubStep))));
    I value = Ops::lt_select(mag, Ops::iset1(1 << C::kFraction), sub, normal);
    if constexpr (F::kSigned) {
        value = Ops::ior(value, Ops::template shl<24>(Ops::iand(code, Ops::iset1(0x80))));
    }
    return Ops::keep(Ops::mul(Ops::from_bits(value), step));
}

/// Stores the first `count` lanes of `x` at `dst` (a full vector when count == kWidth).
template <class Ops, class T, class Store>
inline __attribute__((always_inline)) void store_lanes(T* dst, int64_t count, Store store) {
    if (Ops::kWidth == 1 || count >= Ops::kWidth) {
        store(dst);
        return;
    }
    alignas(64) T tmp[Ops::kWidth];
    store(tmp);
    // NOTE: 0 < count < kWidth here; the mask tells the compiler so.
    std::memcpy(dst, tmp, static_cast<size_t>(count & (Ops::kWidth - 1)) * sizeof(T));
}

/// A pointer to `count` elements at `src`, padded with zeros to a full vector in `tmp`.
template <class Ops, class T>
inline __attribute__((always_inline)) const T* load_lanes(const T* src, int64_t count, T* tmp) {
    if (Ops::kWidth == 1 || count >= Ops::kWidth) return src;
    std::memset(tmp, 0, sizeof(T) * Ops::kWidth);
    std::memcpy(tmp, src, static_cast<size_t>(count & (Ops::kWidth - 1)) * sizeof(T));
    return tmp;
}

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
