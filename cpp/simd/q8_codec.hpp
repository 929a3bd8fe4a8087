// 8-bit block-wise storage of optimizer states (`optimizer_state_dtype="int8"`):
// Adam's two moments (cpp/adam/adam_q8.hpp) and Lion's momentum
// (cpp/lion/lion_math.hpp), decoded and re-encoded inside the fused kernels.
// Written once over an "Ops" backend (scalar, AVX2, AVX-512) like the kernels'
// math, so every ISA stores the same bytes.
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

#include "simd/convert.hpp"
#include "simd/formats.hpp"

namespace infinity::simd::q8 {

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

}  // namespace infinity::simd::q8
