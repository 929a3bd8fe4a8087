// Portable scalar kernel: the reference every vector path must match bit for
// bit, the fallback on CPUs without AVX2, and the tail of the vector kernels.
#include <cmath>

#include "adam/adam_math.hpp"
#include "adam/convert.hpp"
#include "adam/kernels.hpp"

namespace infinity::adam {
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

void adam_range_scalar(const AdamBuffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
    adam_dispatch<ScalarOps>(b, c, begin, end);
}

}  // namespace infinity::adam
