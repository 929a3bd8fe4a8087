// The per-element Lion update (Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms"), written once over an "Ops" backend (scalar, AVX2,
// AVX-512: simd/ops_*.hpp) like the Adam kernel, so every ISA stores the same
// bits. Per element, every line one correctly rounded fp32 operation, in the
// order of the reference (torch ops with Python-float scalars):
//   g = grad * grad_scale
//   p = p * (1 - lr*wd)                      param.mul_(1 - lr * wd)   (wd != 0 only)
//   c = fma(g, 1-beta1, m * beta1)           m.mul(beta1).add(g, alpha=1-beta1)
//   p = p + (-lr) * sign(c)                  param.add_(c.sign(), alpha=-lr)  (exact product)
//   m = fma(g, 1-beta2, m * beta2)           m.mul_(beta2).add_(g, alpha=1-beta2)
// NOTE: ATen's vectorised `add(a, b, alpha)` computes fmadd(b, alpha, a);
// `Ops::keep` stops the compiler from fusing the products into anything else,
// so the scalar path and the vector paths agree bit for bit.
//
// The momentum is stored as fp32, bf16 (stochastic rounding, as the Adam
// moments: simd/stochastic_round.hpp) or int8: the signed block-wise codes of
// the Adam kernel's first moment (simd/q8_codec.hpp), decoded into an L1
// buffer per block of kQBlock elements, updated, re-encoded with the block's
// new absmax. Included by cpp/simd/kernels_<isa>.cpp inside their target regions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "lion/lion_kernels.hpp"
#include "lion/lion_types.hpp"
#include "simd/flat_dispatch.hpp"
#include "simd/q8_codec.hpp"
#include "simd/state_io.hpp"
#include "simd/stochastic_round.hpp"
#include "simd/tags.hpp"

namespace infinity::lion {

using simd::BF16Tag;
using simd::F32Tag;
using simd::kQBlock;
using simd::NoOutTag;

/// The coefficients of LionCoeffs broadcast into vectors of the backend.
template <class Ops>
struct LionVec {
    using V = typename Ops::V;
    V grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;

    explicit LionVec(const LionCoeffs& c)
        : grad_scale(Ops::set1(c.grad_scale)),
          decay(Ops::set1(c.decay)),
          beta1(Ops::set1(c.beta1)),
          one_minus_beta1(Ops::set1(c.one_minus_beta1)),
          beta2(Ops::set1(c.beta2)),
          one_minus_beta2(Ops::set1(c.one_minus_beta2)),
          neg_lr(Ops::set1(c.neg_lr)) {}
};

/// torch.sign: +-1 for any non-zero value (infinities included), the value
/// itself for +-0 and NaN (so a NaN still reaches the parameter).
template <class Ops>
inline __attribute__((always_inline)) typename Ops::V sign_of(typename Ops::V c) {
    using I = typename Ops::I;
    const I u = Ops::bits(c);
    const I magnitude = Ops::iand(u, Ops::iset1(0x7fffffffu));
    const I one = Ops::ior(Ops::iand(u, Ops::iset1(0x80000000u)), Ops::iset1(0x3f800000u));
    // NOTE: magnitudes are non-negative as int32, so signed comparisons order them.
    I s = Ops::lt_select(magnitude, Ops::iset1(0x7f800001u), one, u);  // not NaN: +-1
    s = Ops::lt_select(Ops::iset1(0), magnitude, s, u);                 // +-0 stays
    return Ops::from_bits(s);
}

/// Updates one vector of parameters `p` and momentum `m` given raw gradients `g`.
template <class Ops, bool kDecay>
inline __attribute__((always_inline)) void lion_update(typename Ops::V& p, typename Ops::V g,
                                                       typename Ops::V& m, const LionVec<Ops>& k) {
    g = Ops::keep(Ops::mul(g, k.grad_scale));
    if constexpr (kDecay) p = Ops::keep(Ops::mul(p, k.decay));
    const typename Ops::V c = Ops::fma(g, k.one_minus_beta1, Ops::keep(Ops::mul(m, k.beta1)));
    p = Ops::add(p, Ops::keep(Ops::mul(k.neg_lr, sign_of<Ops>(c))));
    m = Ops::fma(g, k.one_minus_beta2, Ops::keep(Ops::mul(m, k.beta2)));
}

/// Runs the update over elements [begin, end) in whole vectors; returns the
/// index of the first element it did not process. S: fp32 or bf16 momentum.
template <class Ops, class G, class O, class S, bool kDecay>
inline __attribute__((always_inline)) int64_t lion_loop(const LionBuffers& b, const LionCoeffs& c,
                                                        int64_t begin, int64_t end) {
    const LionVec<Ops> k(c);
    const uint32_t key = simd::round_key(c.step, b.round_stream);
    const auto* const grad = static_cast<const typename G::Storage*>(b.grad);
    int64_t i = begin;
    for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
        typename Ops::V p = Ops::load(b.param + i);
        typename Ops::V m = simd::load_moment<Ops, S>(b.exp_avg, i);
        lion_update<Ops, kDecay>(p, Ops::template load_grad<G>(grad + i), m, k);
        Ops::store(b.param + i, p);
        const auto r = simd::moment_bits<Ops, S>(b, key, i);
        simd::store_moment<Ops, S>(b.exp_avg, i, m, simd::low16<Ops>(r));
        if constexpr (!std::is_same_v<O, NoOutTag>) {
            Ops::template store_out<O, false>(static_cast<typename O::Storage*>(b.out16) + i, p);
        }
    }
    return i;
}

/// Updates the `len` (<= kQBlock) elements of one int8 block starting at `i0`.
template <class Ops, class G, class O, bool kDecay>
inline __attribute__((always_inline)) void q8_lion_block(const LionBuffers& b,
                                                         const LionVec<Ops>& k, int64_t i0,
                                                         int64_t len) {
    using V = typename Ops::V;
    using GS = typename G::Storage;
    namespace q8 = simd::q8;
    constexpr int64_t W = Ops::kWidth;
    alignas(64) float m_f32[kQBlock];
    auto* const m_code = static_cast<uint8_t*>(b.exp_avg) + i0;
    const int64_t block = i0 / kQBlock;
    const V m_step = Ops::set1(b.exp_avg_scale[block] / q8::kMax);
    alignas(64) uint8_t codes[W];
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        const auto code = Ops::load_u8(q8::load_lanes<Ops>(m_code + j, count, codes));
        Ops::store(m_f32 + j, q8::decode<Ops, q8::Signed>(code, m_step));
    }
    const auto* const grad = static_cast<const GS*>(b.grad) + i0;
    float* const param = b.param + i0;
    alignas(64) float p_tmp[W];
    alignas(64) GS g_tmp[W];
    V m_max = Ops::set1(0.0f);
    // NOTE: padding lanes hold zeros (codes, parameters, gradients): sign(0) is 0,
    // so they stay zero and cannot raise the block's maximum.
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        V p = Ops::load(q8::load_lanes<Ops>(param + j, count, p_tmp));
        V m = Ops::load(m_f32 + j);
        const V g = Ops::template load_grad<G>(q8::load_lanes<Ops>(grad + j, count, g_tmp));
        lion_update<Ops, kDecay>(p, g, m, k);
        q8::store_lanes<Ops>(param + j, count, [&](float* d) { Ops::store(d, p); });
        if constexpr (!std::is_same_v<O, NoOutTag>) {
            auto* const out = static_cast<typename O::Storage*>(b.out16) + i0 + j;
            q8::store_lanes<Ops>(out, count,
                                 [&](uint16_t* d) { Ops::template store_out<O, false>(d, p); });
        }
        Ops::store(m_f32 + j, m);
        m_max = Ops::max(m_max, Ops::from_bits(Ops::iand(Ops::bits(m), Ops::iset1(0x7fffffff))));
    }
    const float absmax = Ops::hmax(m_max);
    b.exp_avg_scale[block] = absmax;
    const V inv = Ops::set1(q8::inverse_scale(absmax));
    for (int64_t j = 0; j < len; j += W) {
        const int64_t count = len - j < W ? len - j : W;
        const auto code = q8::encode<Ops, q8::Signed>(Ops::load(m_f32 + j), inv);
        q8::store_lanes<Ops>(m_code + j, count, [&](uint8_t* d) { Ops::store_u8(d, code); });
    }
}

/// Dispatches on momentum storage, grad dtype, output dtype and weight decay;
/// returns the index of the first element it did not process (int8: `end`).
template <class Ops>
inline __attribute__((always_inline)) int64_t lion_dispatch(const LionBuffers& b,
                                                            const LionCoeffs& c, int64_t begin,
                                                            int64_t end) {
    auto with_state = [&](auto grad_tag, auto out_tag, auto decay_tag) -> int64_t {
        using G = decltype(grad_tag);
        using O = decltype(out_tag);
        constexpr bool kDecay = decltype(decay_tag)::value;
        switch (b.state) {
            case StateFormat::kF32: return lion_loop<Ops, G, O, F32Tag, kDecay>(b, c, begin, end);
            case StateFormat::kBF16: return lion_loop<Ops, G, O, BF16Tag, kDecay>(b, c, begin, end);
            case StateFormat::kQ8: {
                const LionVec<Ops> k(c);
                for (int64_t i = begin; i < end; i += kQBlock) {
                    q8_lion_block<Ops, G, O, kDecay>(b, k, i, end - i < kQBlock ? end - i : kQBlock);
                }
                return end;
            }
        }
        return begin;  // unreachable: formats are validated before any kernel runs
    };
    return simd::flat_dispatch(b, c.use_decay, begin, with_state);
}

/// Updates elements [begin, end) of `b` over Ops: what each per-ISA entry point
/// (lion_range_<isa>) runs. A vector Ops leaves the elements after the last
/// whole vector (a tensor's tail) to the scalar kernel.
template <class Ops>
inline __attribute__((always_inline)) void lion_range(const LionBuffers& b, const LionCoeffs& c,
                                                      int64_t begin, int64_t end) {
    [[maybe_unused]] const int64_t done = lion_dispatch<Ops>(b, c, begin, end);
    if constexpr (Ops::kWidth > 1) {
        if (done < end) lion_range_scalar(b, c, done, end);
    }
}

}  // namespace infinity::lion
