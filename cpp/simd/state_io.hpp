// Loading and storing one vector of an optimizer state (Adam's moments, Lion's
// momentum, SGD's buffer) kept as fp32 or bf16, over an "Ops" backend: what
// every optimizer's loop does around its update. Included through the
// optimizers' math headers, inside each per-ISA kernel's target region.
#pragma once

#include <cstdint>
#include <type_traits>

#include "simd/stochastic_round.hpp"
#include "simd/tags.hpp"

namespace infinity::simd {

/// Loads one vector of a moment stored as S (F32Tag or BF16Tag) at element i.
template <class Ops, class S>
inline __attribute__((always_inline)) typename Ops::V load_moment(const void* base, int64_t i) {
    if constexpr (std::is_same_v<S, F32Tag>) {
        return Ops::load(static_cast<const float*>(base) + i);
    } else {
        return Ops::template load_grad<BF16Tag>(static_cast<const uint16_t*>(base) + i);
    }
}

/// Stores one vector of a state as S at element i, bf16 rounded to nearest even:
/// SGD's momentum buffer, whose bf16 values match torch's own rounding (a buffer
/// at momentum 0.9 moves by 10% a step, far more than half a bf16 step, so
/// nearest rounding does not freeze it as it would Adam's second moment).
template <class Ops, class S>
inline __attribute__((always_inline)) void store_moment_nearest(void* base, int64_t i,
                                                                typename Ops::V x) {
    if constexpr (std::is_same_v<S, F32Tag>) {
        Ops::store(static_cast<float*>(base) + i, x);
    } else {
        Ops::template store_out<BF16Tag, false>(static_cast<uint16_t*>(base) + i, x);
    }
}

/// Stores one vector of a moment as S at element i; bf16: rounded stochastically
/// with the 16 random bits in the low half of each lane of `r16`
/// (NOTE [bf16 stochastic rounding]).
template <class Ops, class S>
inline __attribute__((always_inline)) void store_moment(void* base, int64_t i, typename Ops::V x,
                                                        typename Ops::I r16) {
    if constexpr (std::is_same_v<S, F32Tag>) {
        Ops::store(static_cast<float*>(base) + i, x);
    } else {
        Ops::store_u16(static_cast<uint16_t*>(base) + i, bf16_stochastic<Ops>(x, r16));
    }
}

/// The random bits of elements [i, i + kWidth) of `b` under `key` (zeros when
/// S is fp32: nothing is rounded, nothing is hashed).
template <class Ops, class S, class B>
inline __attribute__((always_inline)) typename Ops::I moment_bits(const B& b, uint32_t key,
                                                                  int64_t i) {
    if constexpr (std::is_same_v<S, F32Tag>) {
        return Ops::iset1(0);
    } else {
        // NOTE: unsigned, so no offset a caller passes can overflow a signed sum.
        return random_bits<Ops>(key, static_cast<uint64_t>(b.round_offset) + static_cast<uint64_t>(i));
    }
}

}  // namespace infinity::simd
