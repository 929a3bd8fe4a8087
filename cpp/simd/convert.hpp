// Scalar conversions between fp32 and the 16-bit formats. The vector kernels
// produce the same bits: round-to-nearest-even, overflow to infinity,
// subnormals kept, NaN stays a quiet NaN with its sign and top payload bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace infinity::simd {

inline uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

/// bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

/// fp32 -> bf16, round-to-nearest-even; NaN -> quiet NaN (same sign, top payload).
inline uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    // NOTE: adding 0x7fff plus the lowest kept bit rounds half-way cases to
    // even; a carry into the exponent correctly rounds up to the next binade
    // (and the largest finite values to infinity).
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// fp16 -> fp32 is exact (every half is a float); a NaN comes back quiet.
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) {
        return bits_float(sign | 0x7f800000u | (mant ? 0x00400000u | (mant << 13) : 0u));
    }
    if (exp == 0) {
        // Subnormal half: mant * 2^-24, exact in fp32 (and a normal float).
        const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
        return bits_float(sign | float_bits(mag));
    }
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// fp32 -> fp16, round-to-nearest-even, as the F16C/AVX-512 `vcvtps2ph`
/// instruction with rounding mode 0 produces it.
inline uint16_t float_to_half(float f) {
    const uint32_t u = float_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
    if (a >= 0x38800000u) {                                              // normal half
        a += 0xfffu + ((a >> 13) & 1u);                                  // RNE at bit 13
        return static_cast<uint16_t>(sign | ((a - (112u << 23)) >> 13));
    }
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to 0
    // Subnormal half: round (mantissa with implicit bit) * 2^(e-126) to an integer.
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry to the smallest normal
    return static_cast<uint16_t>(sign | q);
}

}  // namespace infinity::simd
