// The fused SGD step over flat buffers: validation, then the active ISA's
// kernel spread over the compute pool.
#include <stdexcept>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "sgd/sgd_kernels.hpp"
#include "simd/flat_step.hpp"
#include "simd/isa.hpp"

namespace infinity::sgd {
namespace {

// The location is the caller's (see NOTE [errors name their source line]).
void require(bool ok, const std::string& message, SourceLocation where = SourceLocation()) {
    if (!ok) throw_error<std::invalid_argument>("sgd_step: " + message, where);
}

void validate(const SgdBuffers& b, const SgdHyper& h) {
    require(b.n >= 0, "n must be >= 0");
    require(simd::known_dtype(b.grad_dtype), "unknown grad dtype code");
    require(b.state == StateFormat::kF32 || b.state == StateFormat::kBF16,
            "momentum_buffer state format must be fp32 or bf16");
    require(b.out16 == nullptr || simd::out16_dtype(b.out_dtype), "out16 dtype must be bf16 or fp16");
    for (double x : {h.lr, h.momentum, h.dampening, h.weight_decay, h.grad_scale}) {
        require(simd::fits_float(x), "hyper-parameters must be finite fp32 values");
    }
    if (b.n == 0) return;
    const bool uses_buffer = h.momentum != 0.0;
    require(b.param && b.grad, "null buffer pointer for a non-empty step");
    require(!uses_buffer || b.momentum_buffer, "momentum != 0 needs a momentum_buffer");
    // NOTE: pointer arithmetic only (Python checked the same before calling).
    std::vector<simd::BufferSpan> states;
    if (uses_buffer) {
        states.push_back(
            simd::buffer_span(b.momentum_buffer, b.n, simd::state_bytes(b.state), "momentum_buffer"));
    }
    const std::string overlap = simd::find_step_overlap(b, states);
    require(overlap.empty(), overlap);
}

}  // namespace

void sgd_step(const SgdBuffers& b, const SgdHyper& h) {
    validate(b, h);
    if (b.n == 0) return;
    simd::run_step_on_pool(b, make_sgd_coeffs(h), sgd_range_fn(simd::active_isa()));
}

SgdRangeFn sgd_range_fn(simd::Isa isa) {
    switch (isa) {
#if defined(__x86_64__)
        case simd::Isa::kAvx512: return sgd_range_avx512;
        case simd::Isa::kAvx2: return sgd_range_avx2;
#endif
        default: return sgd_range_scalar;
    }
}

}  // namespace infinity::sgd
