// Stochastic rounding of fp32 to bf16 for optimizer moments, with random bits
// from a counter-based hash, written once over an "Ops" backend (scalar, AVX2,
// AVX-512) so every ISA stores the same bytes. See
// NOTE [bf16 stochastic rounding] (docs/NOTES.md) for why the moments are rounded this way and what
// the caller's element index is.
//
// The random bits of element `index` of a step are
//   hash32(round_key(step, stream) + (uint32) index)
// with hash32 the "lowbias32" integer finalizer (Chris Wellons' hash-prospector:
// two 32-bit multiplies, three xor-shifts; every output bit depends on every
// input bit). Only integer add, xor, shift and a 32-bit multiply (mod 2^32) are
// used: exact and identical on every ISA, so the bits depend on the element's
// index alone, never on the vector width or the thread that stores it. One
// hash gives 32 bits: the low 16 round the first moment, the high 16 the
// second, so the two roundings of an element are independent.
#pragma once

#include <cstdint>

namespace infinity::simd {

/// The fixed seed of the moments' random bits. There is no run seed to take
/// (Config has none): a fixed one keeps two runs of the same job identical.
inline constexpr uint32_t kRoundSeed = 0x1f0e2d3cu;

/// lowbias32: a bijective 32-bit finalizer with low bias (scalar).
inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/// The key of one call: mixes the seed, the step count and the caller's stream
/// (e.g. a chunk index), 32 bits at a time, so every step and stream draws
/// different bits for the same element index.
inline uint32_t round_key(int64_t step, uint64_t stream) {
    const auto step_bits = static_cast<uint64_t>(step);
    const uint32_t words[] = {static_cast<uint32_t>(step_bits), static_cast<uint32_t>(step_bits >> 32),
                              static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)};
    uint32_t h = kRoundSeed;
    for (uint32_t w : words) h = hash32(h ^ w);
    return h;
}

/// hash32 of every lane of `x` (the vector form of hash32, same bits).
template <class Ops>
inline __attribute__((always_inline)) typename Ops::I hash32_lanes(typename Ops::I x) {
    x = Ops::ixor(x, Ops::template shr<16>(x));
    x = Ops::imul(x, Ops::iset1(0x7feb352du));
    x = Ops::ixor(x, Ops::template shr<15>(x));
    x = Ops::imul(x, Ops::iset1(0x846ca68bu));
    return Ops::ixor(x, Ops::template shr<16>(x));
}

/// The 32 random bits of the elements [index, index + kWidth) under `key`.
/// NOTE: indices are taken mod 2^32: elements 2^32 apart in one stream share
/// bits, harmless for rounding (they are different values).
template <class Ops>
inline __attribute__((always_inline)) typename Ops::I random_bits(uint32_t key, uint64_t index) {
    const uint32_t first = key + static_cast<uint32_t>(index);
    return hash32_lanes<Ops>(Ops::iadd(Ops::iset1(first), Ops::iota()));
}

/// bf16 bits (one per 32-bit lane) of `x` rounded stochastically with the 16
/// random bits in the low half of each lane of `r16`: adding them to the fp32
/// bits and truncating rounds the magnitude up with probability (dropped
/// bits) / 2^16, so the expected stored value is x. A value bf16 holds exactly
/// is kept; a carry moves to the next binade (beyond the largest finite bf16:
/// infinity, as the nearest rounding would for values that far up); infinities
/// stay; NaN becomes a quiet NaN with its sign and top payload (as float_to_bf16).
template <class Ops>
inline __attribute__((always_inline)) typename Ops::I bf16_stochastic(typename Ops::V x,
                                                                      typename Ops::I r16) {
    using I = typename Ops::I;
    const I u = Ops::bits(x);
    const I rounded = Ops::template shr<16>(Ops::iadd(u, r16));
    const I quiet_nan = Ops::ior(Ops::template shr<16>(u), Ops::iset1(0x40));
    // NOTE: magnitudes are non-negative as int32, so the signed comparison orders them.
    const I magnitude = Ops::iand(u, Ops::iset1(0x7fffffffu));
    return Ops::lt_select(Ops::iset1(0x7f800000u), magnitude, quiet_nan, rounded);
}

/// The low / high 16 random bits of each lane (first / second moment).
template <class Ops>
inline __attribute__((always_inline)) typename Ops::I low16(typename Ops::I r) {
    return Ops::iand(r, Ops::iset1(0xffffu));
}
template <class Ops>
inline __attribute__((always_inline)) typename Ops::I high16(typename Ops::I r) {
    return Ops::template shr<16>(r);
}

}  // namespace infinity::simd
