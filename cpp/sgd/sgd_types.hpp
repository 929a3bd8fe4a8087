// Types of the fused CPU-SGD kernel: the buffers of one step and the float
// coefficients derived once per call from the hyper-parameters. Dtype and
// state-format codes are every kernel's (simd/formats.hpp), so Python passes
// the same codes to all.
#pragma once

#include <cstdint>

#include "simd/formats.hpp"

namespace infinity::sgd {

using simd::DType;
using simd::StateFormat;

/// Flat buffers of one step; all hold `n` elements and do not overlap.
struct SgdBuffers {
    float* param = nullptr;            ///< fp32 master parameters, updated in place
    const void* grad = nullptr;        ///< gradients, `grad_dtype`
    void* momentum_buffer = nullptr;   ///< `state` (fp32 or bf16); untouched if momentum == 0
    void* out16 = nullptr;             ///< optional 16-bit copy of the updated params
    int64_t n = 0;
    DType grad_dtype = DType::kF32;
    DType out_dtype = DType::kBF16;    ///< only read when out16 != nullptr
    StateFormat state = StateFormat::kF32;
};

/// Hyper-parameters of one step as the user gives them (double, like Python
/// floats), torch.optim.SGD's, plus the gradient scale and whether this is the
/// buffer's first step (torch then sets the buffer to the gradient).
struct SgdHyper {
    double lr = 1e-3;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    double grad_scale = 1.0;
    bool nesterov = false;
    bool maximize = false;
    bool first_step = false;
};

/// What a step does with the momentum buffer.
enum class Momentum : int {
    kNone = 0,     ///< momentum == 0: no buffer, g is the direction
    kFirst = 1,    ///< the buffer's first step: buf = g
    kRunning = 2,  ///< buf = momentum * buf + (1 - dampening) * g
};

/// Per-call float constants, each rounded to float once from the double that
/// the reference (torch ops with Python-float scalars) rounds.
struct SgdCoeffs {
    float grad_scale;           ///< g *= grad_scale, negated for maximize (exact either way)
    bool use_decay;             ///< weight_decay != 0
    float weight_decay;         ///< g += weight_decay * p
    Momentum mode;
    bool nesterov;
    float momentum;
    float one_minus_dampening;  ///< buf += (1 - dampening) * g
    float neg_lr;               ///< p += neg_lr * direction
};

/// Derives the float constants of one call (see SgdCoeffs).
inline SgdCoeffs make_sgd_coeffs(const SgdHyper& h) {
    SgdCoeffs c{};
    // NOTE: round-to-nearest-even is symmetric, so g * (-s) == -(g * s) bit
    // for bit: maximize costs no operation of its own.
    c.grad_scale = static_cast<float>(h.maximize ? -h.grad_scale : h.grad_scale);
    c.use_decay = h.weight_decay != 0.0;
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.mode = h.momentum == 0.0 ? Momentum::kNone
             : h.first_step    ? Momentum::kFirst
                               : Momentum::kRunning;
    c.nesterov = h.nesterov && c.mode != Momentum::kNone;
    c.momentum = static_cast<float>(h.momentum);
    c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
    c.neg_lr = static_cast<float>(-h.lr);
    return c;
}

}  // namespace infinity::sgd
