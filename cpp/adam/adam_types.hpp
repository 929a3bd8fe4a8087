// Types of the CPU-Adam kernel: the buffers of one step and the float
// coefficients derived once per call from the hyper-parameters. Dtype and
// state-format codes are every kernel's (simd/formats.hpp).
#pragma once

#include <cstdint>

#include "simd/formats.hpp"

namespace infinity::adam {

using simd::DType;
using simd::kQBlock;
using simd::StateFormat;

/// Flat buffers of one step; all hold `n` elements and do not overlap.
struct AdamBuffers {
    float* param = nullptr;       ///< fp32 master parameters, updated in place
    const void* grad = nullptr;   ///< gradients, `grad_dtype`
    void* exp_avg = nullptr;      ///< first moment, `state`, updated in place
    void* exp_avg_sq = nullptr;   ///< second moment, `state`, updated in place
    float* exp_avg_scale = nullptr;     ///< kQ8: absmax of each block of exp_avg
    float* exp_avg_sq_scale = nullptr;  ///< kQ8: max of each block of exp_avg_sq
    void* out16 = nullptr;        ///< optional 16-bit copy of the updated params
    int64_t n = 0;
    DType grad_dtype = DType::kF32;
    DType out_dtype = DType::kBF16;  ///< only read when out16 != nullptr
    StateFormat state = StateFormat::kF32;
    // kBF16: where the elements are in the caller's numbering, for the random
    // bits of the stochastic rounding (NOTE [bf16 stochastic rounding]):
    // element i of these buffers is element round_offset + i of stream round_stream.
    uint64_t round_stream = 0;
    int64_t round_offset = 0;
};

/// Hyper-parameters of one step as the user gives them (double, like Python floats).
struct AdamHyper {
    int64_t step = 1;  ///< 1-based step count after the increment
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
    bool adamw = true;
    double grad_scale = 1.0;
};

/// Per-call float constants. Each is computed in double and rounded to float
/// once, exactly where torch rounds its Python-float scalars to the tensor
/// dtype, so the per-element math sees the same constants as torch's.
struct AdamCoeffs {
    float grad_scale;     ///< g *= grad_scale (unscale + clip factor)
    float l2;             ///< Adam (L2) mode: g += l2 * p; 0 in AdamW mode
    bool use_l2;          ///< whether the L2 term is applied at all
    float decay;          ///< AdamW mode: p *= decay = 1 - lr*wd; 1 otherwise
    float lerp_coeff;     ///< m = fma(lerp_coeff, g - m, base)
    bool lerp_from_grad;  ///< base = g (weight >= 0.5) instead of m
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;       ///< sqrt(1 - beta2^step)
    float eps;
    float neg_step_size;  ///< -lr / (1 - beta1^step)
    int64_t step;         ///< the step count, for the random bits of bf16 moments
};

/// Derives the float constants of one call (see AdamCoeffs).
AdamCoeffs make_coeffs(const AdamHyper& h);

}  // namespace infinity::adam
