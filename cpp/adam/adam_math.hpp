// The per-element Adam/AdamW update, written once over an "Ops" backend
// (scalar float, AVX2 __m256, AVX-512 __m512), so every ISA performs the same
// IEEE operations in the same order and produces the same bits.
//
// Order of operations, after torch 2.13 (`_single_tensor_adam` and the fused
// CPU kernel); every line is one correctly rounded fp32 operation:
//   g   = grad * grad_scale
//   g   = fma(p, wd, g)                       Adam (L2) only: grad.add(param, alpha=wd)
//   p   = p * (1 - lr*wd)                     AdamW only:     param.mul_(1 - lr*wd)
//   m   = fma(c, g - m, base)                 exp_avg.lerp_(grad, 1-beta1), as ATen's
//                                             vectorised lerp: c = w, base = m when
//                                             |w| < 0.5, else c = w - 1, base = g
//   v   = fma((1-beta2) * g, g, v * beta2)    exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2)
//   den = sqrt(v) / sqrt(1-beta2^t) + eps     (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
//   p   = p + (-lr/(1-beta1^t) * m) / den     param.addcdiv_(exp_avg, den, value=-step_size)
//
// NOTE: torch's own CPU kernels may or may not contract `a*b + c` into one
// FMA depending on how ATen was compiled, so results agree with torch to a
// few ulps per step, not bitwise. Within this project they are bitwise
// reproducible: `Ops::keep` stops the compiler from contracting the two
// products that feed an addition, so the scalar path (no FMA instructions
// unless std::fma is called) and the vector paths match exactly.
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_types.hpp"
#include "simd/state_io.hpp"
#include "simd/stochastic_round.hpp"
#include "simd/tags.hpp"

namespace infinity::adam {

using simd::BF16Tag;
using simd::F32Tag;
using simd::NoOutTag;

/// The coefficients of AdamCoeffs broadcast into vectors of the backend.
template <class Ops>
struct VecCoeffs {
    using V = typename Ops::V;
    V grad_scale, l2, decay, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
    bool lerp_from_grad;

    explicit VecCoeffs(const AdamCoeffs& c)
        : grad_scale(Ops::set1(c.grad_scale)),
          l2(Ops::set1(c.l2)),
          decay(Ops::set1(c.decay)),
          lerp_coeff(Ops::set1(c.lerp_coeff)),
          beta2(Ops::set1(c.beta2)),
          one_minus_beta2(Ops::set1(c.one_minus_beta2)),
          bc2_sqrt(Ops::set1(c.bc2_sqrt)),
          eps(Ops::set1(c.eps)),
          neg_step_size(Ops::set1(c.neg_step_size)),
          lerp_from_grad(c.lerp_from_grad) {}
};

/// Updates one vector of parameters `p` and moments `m`, `v` given raw gradients `g`.
template <class Ops, bool kL2>
inline __attribute__((always_inline)) void adam_update(typename Ops::V& p, typename Ops::V g,
                                                       typename Ops::V& m, typename Ops::V& v,
                                                       const VecCoeffs<Ops>& k) {
    using V = typename Ops::V;
    g = Ops::keep(Ops::mul(g, k.grad_scale));
    if constexpr (kL2) g = Ops::fma(p, k.l2, g);
    p = Ops::keep(Ops::mul(p, k.decay));
    const V base = k.lerp_from_grad ? g : m;
    m = Ops::fma(k.lerp_coeff, Ops::sub(g, m), base);
    v = Ops::fma(Ops::mul(k.one_minus_beta2, g), g, Ops::mul(v, k.beta2));
    const V den = Ops::add(Ops::div(Ops::sqrt(v), k.bc2_sqrt), k.eps);
    p = Ops::add(p, Ops::div(Ops::mul(k.neg_step_size, m), den));
}

/// Updates elements [i, i + Ops::kWidth); kStream: write out16 with streaming
/// stores; S: how the moments are stored (F32Tag or BF16Tag); key: round_key().
template <class Ops, class G, class O, class S, bool kL2, bool kStream>
inline __attribute__((always_inline)) void adam_vector(const AdamBuffers& b,
                                                       const VecCoeffs<Ops>& k, uint32_t key,
                                                       int64_t i) {
    using V = typename Ops::V;
    const auto* const grad = static_cast<const typename G::Storage*>(b.grad);
    V p = Ops::load(b.param + i);
    V m = simd::load_moment<Ops, S>(b.exp_avg, i);
    V v = simd::load_moment<Ops, S>(b.exp_avg_sq, i);
    adam_update<Ops, kL2>(p, Ops::template load_grad<G>(grad + i), m, v, k);
    Ops::store(b.param + i, p);
    const typename Ops::I r = simd::moment_bits<Ops, S>(b, key, i);
    simd::store_moment<Ops, S>(b.exp_avg, i, m, simd::low16<Ops>(r));
    simd::store_moment<Ops, S>(b.exp_avg_sq, i, v, simd::high16<Ops>(r));
    if constexpr (!std::is_same_v<O, NoOutTag>) {
        // NOTE: the parameters' 16-bit copy stays round-to-nearest: it is
        // rewritten from the fp32 master every step, so its error never accumulates.
        Ops::template store_out<O, kStream>(static_cast<typename O::Storage*>(b.out16) + i, p);
    }
}

/// Runs the update over elements [begin, end) in whole vectors of Ops::kWidth
/// and returns the index of the first element it did not process.
template <class Ops, class G, class O, class S, bool kL2, bool kStream>
inline __attribute__((always_inline)) int64_t adam_loop(const AdamBuffers& b, const AdamCoeffs& c,
                                                        int64_t begin, int64_t end) {
    // One 64-byte line of every fp32 stream per iteration.
    constexpr int64_t kLine = 16;
    // NOTE: software prefetch this many elements (1 KiB of each fp32 stream)
    // ahead. The hardware prefetchers alone keep too few lines in flight while
    // the core is busy with the divisions: measured on a 2-core Xeon with
    // 64M parameters, 2 threads, +10-20% (from ~82% to ~95-100% of the
    // bandwidth of the same access pattern without arithmetic); 128 to 512
    // elements all did about as well, 0 clearly worse.
    constexpr int64_t kAhead = 256;
    const VecCoeffs<Ops> k(c);
    const uint32_t key = simd::round_key(c.step, b.round_stream);
    const auto* const grad = static_cast<const typename G::Storage*>(b.grad);
    const int64_t prefetch_end = b.n - kAhead;  // never form a pointer past the buffers
    int64_t i = begin;
    if constexpr (Ops::kWidth > 1) {
        for (; i + kLine <= end; i += kLine) {
            if (i < prefetch_end) {
                __builtin_prefetch(b.param + i + kAhead, 1, 3);
                __builtin_prefetch(static_cast<typename S::Storage*>(b.exp_avg) + i + kAhead, 1, 3);
                __builtin_prefetch(static_cast<typename S::Storage*>(b.exp_avg_sq) + i + kAhead, 1, 3);
                __builtin_prefetch(grad + i + kAhead, 0, 3);
            }
            for (int64_t j = 0; j < kLine; j += Ops::kWidth) adam_vector<Ops, G, O, S, kL2, kStream>(b, k, key, i + j);
        }
    }
    for (; i + Ops::kWidth <= end; i += Ops::kWidth) adam_vector<Ops, G, O, S, kL2, kStream>(b, k, key, i);
    return i;
}

/// Whether to write the 16-bit output with non-temporal (streaming) stores.
///
/// NOTE: the output is the only buffer the kernel writes without reading it.
/// Ordinary stores first read every line of it from memory (read-for-
/// ownership), 2 extra bytes per parameter on top of 28; streaming stores
/// skip that read: +5-10% in mixed mode, measured like the prefetch
/// distance. Small calls keep ordinary stores, so an output the caller reads
/// right away stays in cache. Streaming needs vector-aligned addresses.
template <class Ops>
inline bool stream_out(const AdamBuffers& b, int64_t begin) {
    constexpr int64_t kMinElements = int64_t{1} << 16;
    const auto address = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out16) + begin);
    return Ops::kWidth > 1 && b.n >= kMinElements &&
           address % (Ops::kWidth * sizeof(uint16_t)) == 0;
}

}  // namespace infinity::adam
