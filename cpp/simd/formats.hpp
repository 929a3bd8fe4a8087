// The element formats every optimizer kernel shares: the dtype of a gradient or
// of the 16-bit copy of the parameters, and how an optimizer state is stored.
// Python passes the same codes to every kernel; they are exported as
// `_C.adam.dtype_codes`, `out16_dtype_codes`, `state_formats` (cpp/adam/bind_adam.cpp)
// and read by infinity/_native/adam.py.
#pragma once

#include <cstdint>

namespace infinity::simd {

/// Element type of the gradient buffer and of the optional 16-bit output.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// The codes Python passes for each DType, by torch's dtype name.
struct DTypeInfo {
    DType code;
    const char* name;  ///< `torch.<name>`
    bool out16;        ///< allowed as the dtype of the optional 16-bit output
};
inline constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "float32", false},
    {DType::kBF16, "bfloat16", true},
    {DType::kF16, "float16", true},
};

/// Whether `d` is a known dtype (as a gradient) / allowed as the 16-bit output.
constexpr bool known_dtype(DType d) {
    for (const DTypeInfo& t : kDTypes) {
        if (t.code == d) return true;
    }
    return false;
}
constexpr bool out16_dtype(DType d) {
    for (const DTypeInfo& t : kDTypes) {
        if (t.code == d) return t.out16;
    }
    return false;
}

/// How an optimizer's states (Adam's two moments, Lion's momentum, SGD's
/// buffer) are stored (`Config(optimizer_state_dtype=...)`); the update itself
/// always runs in fp32.
enum class StateFormat : int {
    kF32 = 0,   ///< fp32, exact
    kBF16 = 1,  ///< bfloat16 (the moments: stochastic rounding on every store, stochastic_round.hpp)
    kQ8 = 2,    ///< 8-bit codes per element plus one fp32 absmax per kQBlock elements (q8_codec.hpp)
};

/// The codes Python passes for each StateFormat, by config name.
struct StateFormatInfo {
    StateFormat code;
    const char* name;    ///< the value of `Config.optimizer_state_dtype`
    int element_bytes;   ///< bytes per element of each state (without the block scales)
};
inline constexpr StateFormatInfo kStateFormats[] = {
    {StateFormat::kF32, "fp32", 4},
    {StateFormat::kBF16, "bf16", 2},
    {StateFormat::kQ8, "int8", 1},
};

/// Elements per quantisation block of kQ8 (one fp32 scale each). See NOTE [int8 block size].
inline constexpr int64_t kQBlock = 256;

}  // namespace infinity::simd
