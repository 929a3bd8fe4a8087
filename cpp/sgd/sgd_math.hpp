// The per-element SGD update of torch.optim.SGD, written once over an "Ops"
// backend (scalar, AVX2, AVX-512: simd/ops_*.hpp) like the Adam and Lion
// kernels, so every ISA stores the same bits. Per element, every line one
// correctly rounded fp32 operation, in the order of torch's single-tensor SGD
// (Python-float scalars are rounded to float once, as ATen's CPU kernels do):
//   g = grad * (+-grad_scale)                 -grad (maximize), unscaled by the caller
//   g = fma(p, wd, g)                         grad.add(param, alpha=wd)         (wd != 0)
//   buf = g                                   torch.clone(grad)                 (first step)
//   buf = fma(g, 1-dampening, buf * mom)      buf.mul_(mom).add_(grad, alpha=1-dampening)
//   g = fma(buf, mom, g)  or  g = buf         grad.add(buf, alpha=mom) (nesterov) or buf
//   p = fma(g, -lr, p)                        param.add_(grad, alpha=-lr)
// NOTE: ATen's CPU `add(a, b, alpha)` computes fmadd(b, alpha, a), in its
// vector loop and in its scalar tail alike (tests/optim/test_sgd_kernel.py
// checks this against torch.optim.SGD bit for bit); `Ops::keep` stops the
// compiler from fusing the lone products into anything else.
//
// The buffer is stored as fp32 or bf16 (round-to-nearest-even on every store);
// the step itself uses the fp32 value before rounding, as torch uses its buffer.
// Included by cpp/simd/kernels_<isa>.cpp inside their target regions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "sgd/sgd_kernels.hpp"
#include "sgd/sgd_types.hpp"
#include "simd/flat_dispatch.hpp"
#include "simd/state_io.hpp"
#include "simd/tags.hpp"

namespace infinity::sgd {

using simd::BF16Tag;
using simd::F32Tag;
using simd::NoOutTag;

/// The coefficients of SgdCoeffs broadcast into vectors of the backend.
template <class Ops>
struct SgdVec {
    using V = typename Ops::V;
    V grad_scale, weight_decay, momentum, one_minus_dampening, neg_lr;

    explicit SgdVec(const SgdCoeffs& c)
        : grad_scale(Ops::set1(c.grad_scale)),
          weight_decay(Ops::set1(c.weight_decay)),
          momentum(Ops::set1(c.momentum)),
          one_minus_dampening(Ops::set1(c.one_minus_dampening)),
          neg_lr(Ops::set1(c.neg_lr)) {}
};

/// Updates one vector of parameters `p` (and the buffer `buf` unless kMode is
/// kNone) given raw gradients `g`.
template <class Ops, Momentum kMode, bool kNesterov, bool kDecay>
inline __attribute__((always_inline)) void sgd_update(typename Ops::V& p, typename Ops::V g,
                                                      typename Ops::V& buf, const SgdVec<Ops>& k) {
    g = Ops::keep(Ops::mul(g, k.grad_scale));
    if constexpr (kDecay) g = Ops::fma(p, k.weight_decay, g);
    if constexpr (kMode == Momentum::kFirst) buf = g;
    if constexpr (kMode == Momentum::kRunning) {
        buf = Ops::fma(g, k.one_minus_dampening, Ops::keep(Ops::mul(buf, k.momentum)));
    }
    if constexpr (kMode != Momentum::kNone) g = kNesterov ? Ops::fma(buf, k.momentum, g) : buf;
    p = Ops::fma(g, k.neg_lr, p);
}

/// Runs the update over elements [begin, end) in whole vectors; returns the
/// index of the first element it did not process. S: fp32 or bf16 buffer.
template <class Ops, class G, class O, class S, Momentum kMode, bool kNesterov, bool kDecay>
inline __attribute__((always_inline)) int64_t sgd_loop(const SgdBuffers& b, const SgdCoeffs& c,
                                                       int64_t begin, int64_t end) {
    using V = typename Ops::V;
    const SgdVec<Ops> k(c);
    const auto* const grad = static_cast<const typename G::Storage*>(b.grad);
    int64_t i = begin;
    for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
        V p = Ops::load(b.param + i);
        V buf = Ops::set1(0.0f);
        // NOTE: the first step writes the buffer without reading it: a new
        // buffer may hold anything (torch's starts as a clone of the gradient).
        if constexpr (kMode == Momentum::kRunning) buf = simd::load_moment<Ops, S>(b.momentum_buffer, i);
        sgd_update<Ops, kMode, kNesterov, kDecay>(p, Ops::template load_grad<G>(grad + i), buf, k);
        Ops::store(b.param + i, p);
        if constexpr (kMode != Momentum::kNone) simd::store_moment_nearest<Ops, S>(b.momentum_buffer, i, buf);
        if constexpr (!std::is_same_v<O, NoOutTag>) {
            Ops::template store_out<O, false>(static_cast<typename O::Storage*>(b.out16) + i, p);
        }
    }
    return i;
}

/// Dispatches on momentum mode, Nesterov, buffer storage, grad dtype, output
/// dtype and weight decay; returns the index of the first element it did not
/// process.
template <class Ops>
inline __attribute__((always_inline)) int64_t sgd_dispatch(const SgdBuffers& b, const SgdCoeffs& c,
                                                           int64_t begin, int64_t end) {
    auto with_mode = [&](auto grad_tag, auto out_tag, auto decay_tag) -> int64_t {
        using G = decltype(grad_tag);
        using O = decltype(out_tag);
        constexpr bool kDecay = decltype(decay_tag)::value;
        auto with_buffer = [&](auto mode_tag, auto nesterov_tag) -> int64_t {
            constexpr Momentum kMode = decltype(mode_tag)::value;
            constexpr bool kNesterov = decltype(nesterov_tag)::value;
            if (b.state == StateFormat::kBF16) {
                return sgd_loop<Ops, G, O, BF16Tag, kMode, kNesterov, kDecay>(b, c, begin, end);
            }
            return sgd_loop<Ops, G, O, F32Tag, kMode, kNesterov, kDecay>(b, c, begin, end);
        };
        using First = std::integral_constant<Momentum, Momentum::kFirst>;
        using Running = std::integral_constant<Momentum, Momentum::kRunning>;
        switch (c.mode) {
            case Momentum::kNone:
                return sgd_loop<Ops, G, O, F32Tag, Momentum::kNone, false, kDecay>(b, c, begin, end);
            case Momentum::kFirst:
                if (c.nesterov) return with_buffer(First{}, std::true_type{});
                return with_buffer(First{}, std::false_type{});
            case Momentum::kRunning:
                if (c.nesterov) return with_buffer(Running{}, std::true_type{});
                return with_buffer(Running{}, std::false_type{});
        }
        return begin;  // unreachable: make_sgd_coeffs sets a known mode
    };
    return simd::flat_dispatch(b, c.use_decay, begin, with_mode);
}

/// Updates elements [begin, end) of `b` over Ops: what each per-ISA entry point
/// (sgd_range_<isa>) runs. A vector Ops leaves the elements after the last
/// whole vector (a tensor's tail) to the scalar kernel.
template <class Ops>
inline __attribute__((always_inline)) void sgd_range(const SgdBuffers& b, const SgdCoeffs& c,
                                                     int64_t begin, int64_t end) {
    [[maybe_unused]] const int64_t done = sgd_dispatch<Ops>(b, c, begin, end);
    if constexpr (Ops::kWidth > 1) {
        if (done < end) sgd_range_scalar(b, c, done, end);
    }
}

}  // namespace infinity::sgd
