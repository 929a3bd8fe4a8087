// The scalar "Ops" backend of the CPU optimizer kernels: one float per
// "vector". The reference every vector backend must match bit for bit, the
// fallback on CPUs without AVX2, and the tail of the vector kernels: every
// optimizer's scalar kernel (kernels_scalar.cpp) and the int8 codec's
// state-dict conversions run over it.
//
// NOTE: in an unnamed namespace, like the vector backends (ops_avx2.hpp): every
// translation unit that includes it gets its own internal copy, so no inline
// function of a backend is ever merged across units built with different
// target options.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd/convert.hpp"
#include "simd/tags.hpp"

namespace infinity::simd {
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
    static I ixor(I a, I b) { return a ^ b; }
    static I imul(I a, I b) { return a * b; }  ///< the low 32 bits of the product
    static I iota() { return 0; }              ///< lane indices 0 .. kWidth-1
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
    static void store_u16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }

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
}  // namespace infinity::simd
