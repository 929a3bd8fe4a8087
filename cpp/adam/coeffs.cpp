// Per-call constants of the update, rounded where torch rounds them.
#include <cmath>

#include "adam/adam_types.hpp"

namespace infinity::adam {

AdamCoeffs make_coeffs(const AdamHyper& h) {
    // NOTE: torch computes these in Python floats (double) and each tensor op
    // rounds its scalar argument to fp32; we round the same doubles once.
    const double step = static_cast<double>(h.step);
    const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
    const float lerp_weight = static_cast<float>(1.0 - h.beta1);
    // ATen's lerp: c = w, base = start when |w| < 0.5; else c = w - 1 (in
    // fp32), base = end, which is more accurate for weights near 1.
    const bool lerp_from_grad = !(std::fabs(lerp_weight) < 0.5f);

    AdamCoeffs c{};
    c.grad_scale = static_cast<float>(h.grad_scale);
    c.use_l2 = !h.adamw && h.weight_decay != 0.0;
    c.l2 = c.use_l2 ? static_cast<float>(h.weight_decay) : 0.0f;
    c.decay = (h.adamw && h.weight_decay != 0.0) ? static_cast<float>(1.0 - h.lr * h.weight_decay)
                                                 : 1.0f;
    c.lerp_coeff = lerp_from_grad ? lerp_weight - 1.0f : lerp_weight;
    c.lerp_from_grad = lerp_from_grad;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));  // Python: bc2 ** 0.5
    c.eps = static_cast<float>(h.eps);
    c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
    c.step = h.step;
    return c;
}

}  // namespace infinity::adam
