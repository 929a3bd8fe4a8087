#include "lion/lion_step.hpp"

#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "lion/lion_kernels.hpp"
#include "simd/flat_step.hpp"
#include "simd/isa.hpp"

namespace infinity::lion {
namespace {

// The location is the caller's (see NOTE [errors name their source line]).
void require(bool ok, const std::string& message, SourceLocation where = SourceLocation()) {
    if (!ok) throw_error<std::invalid_argument>("lion_step: " + message, where);
}

void validate(const LionBuffers& b, const LionHyper& h) {
    require(b.n >= 0, "n must be >= 0");
    require(h.step >= 1, "step must be >= 1 (the step count after the increment)");
    require(b.round_offset >= 0, "round_offset must be >= 0");
    require(simd::known_dtype(b.grad_dtype), "unknown grad dtype code");
    require(simd::state_bytes(b.state) != 0, "unknown optimizer state format code");
    require(b.out16 == nullptr || simd::out16_dtype(b.out_dtype), "out16 dtype must be bf16 or fp16");
    for (double x : {h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale}) {
        require(simd::fits_float(x), "hyper-parameters must be finite fp32 values");
    }
    require(simd::fits_float(1.0 - h.lr * h.weight_decay),
            "1 - lr * weight_decay must be a finite fp32 value");
    if (b.n == 0) return;
    require(b.param && b.grad && b.exp_avg, "null buffer pointer for a non-empty step");
    require(b.state != StateFormat::kQ8 || b.exp_avg_scale, "int8 momentum needs its block scales");
    // NOTE: pointer arithmetic only (Python checked the same before calling).
    std::vector<simd::BufferSpan> states = {
        simd::buffer_span(b.exp_avg, b.n, simd::state_bytes(b.state), "exp_avg")};
    if (b.state == StateFormat::kQ8) {
        states.push_back(simd::buffer_span(b.exp_avg_scale, (b.n + simd::kQBlock - 1) / simd::kQBlock,
                                           4, "exp_avg_scale"));
    }
    const std::string overlap = simd::find_step_overlap(b, states);
    require(overlap.empty(), overlap);
}

}  // namespace

void lion_step(const LionBuffers& b, const LionHyper& h) {
    validate(b, h);
    if (b.n == 0) return;
    simd::run_step_on_pool(b, make_lion_coeffs(h), lion_range_fn(simd::active_isa()));
}

LionRangeFn lion_range_fn(simd::Isa isa) {
    switch (isa) {
#if defined(__x86_64__)
        case simd::Isa::kAvx512: return lion_range_avx512;
        case simd::Isa::kAvx2: return lion_range_avx2;
#endif
        default: return lion_range_scalar;
    }
}

}  // namespace infinity::lion
