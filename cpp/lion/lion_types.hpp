// Types of the fused CPU-Lion kernel: the buffers of one step and the float
// coefficients derived once per call from the hyper-parameters. Dtype and
// state-format codes are every kernel's (simd/formats.hpp), so Python passes
// the same codes to all.
#pragma once

#include <cstdint>

#include "simd/formats.hpp"

namespace infinity::lion {

using simd::DType;
using simd::StateFormat;

/// Flat buffers of one step; all hold `n` elements and do not overlap.
struct LionBuffers {
    float* param = nullptr;        ///< fp32 master parameters, updated in place
    const void* grad = nullptr;    ///< gradients, `grad_dtype`
    void* exp_avg = nullptr;       ///< the momentum, `state`, updated in place
    float* exp_avg_scale = nullptr;  ///< kQ8: absmax of each block of exp_avg
    void* out16 = nullptr;         ///< optional 16-bit copy of the updated params
    int64_t n = 0;
    DType grad_dtype = DType::kF32;
    DType out_dtype = DType::kBF16;  ///< only read when out16 != nullptr
    StateFormat state = StateFormat::kF32;
    // kBF16: element i is element round_offset + i of stream round_stream, for the
    // random bits of the stochastic rounding (as AdamBuffers; NOTE [bf16 stochastic rounding]).
    uint64_t round_stream = 0;
    int64_t round_offset = 0;
};

/// Hyper-parameters of one step as the user gives them (double, like Python floats).
struct LionHyper {
    double lr = 1e-4;
    double beta1 = 0.9;
    double beta2 = 0.99;
    double weight_decay = 0.0;
    double grad_scale = 1.0;
    int64_t step = 1;  ///< 1-based step count: only draws the random bits of a bf16 momentum
};

/// Per-call float constants, each rounded to float once from the double that
/// the reference (torch ops with Python-float scalars) rounds.
struct LionCoeffs {
    float grad_scale;        ///< g *= grad_scale (unscale + clip factor)
    bool use_decay;          ///< weight_decay != 0
    float decay;             ///< p *= decay = 1 - lr*wd
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float neg_lr;            ///< p += neg_lr * sign(c)
    int64_t step;            ///< for the random bits of a bf16 momentum
};

/// Derives the float constants of one call (see LionCoeffs).
inline LionCoeffs make_lion_coeffs(const LionHyper& h) {
    LionCoeffs c{};
    c.grad_scale = static_cast<float>(h.grad_scale);
    c.use_decay = h.weight_decay != 0.0;
    c.decay = c.use_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
    c.beta1 = static_cast<float>(h.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.neg_lr = static_cast<float>(-h.lr);
    c.step = h.step;
    return c;
}

}  // namespace infinity::lion
