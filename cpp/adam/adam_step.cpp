#include "adam/adam_step.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>

#include "adam/kernels.hpp"
#include "common/error.hpp"
#include "simd/flat_step.hpp"
#include "simd/isa.hpp"

namespace infinity::adam {
namespace {

// The location is the caller's (see NOTE [errors name their source line]),
// so a message points at the check that failed rather than at this helper.
void require(bool ok, const std::string& message, SourceLocation where = SourceLocation()) {
    if (!ok) throw_error<std::invalid_argument>(message, where);
}

void validate(const AdamBuffers& b, const AdamHyper& h, const std::string& where) {
    require(b.n >= 0, where + "n must be >= 0");
    require(b.round_offset >= 0, where + "round_offset must be >= 0");
    require(h.step >= 1, where + "step must be >= 1 (the step count after the increment)");
    require(simd::known_dtype(b.grad_dtype), where + "unknown grad dtype code");
    require(simd::state_bytes(b.state) != 0, where + "unknown optimizer state format code");
    require(b.out16 == nullptr || simd::out16_dtype(b.out_dtype),
            where + "out16 dtype must be bf16 or fp16");
    if (b.n > 0) {
        require(b.param && b.grad && b.exp_avg && b.exp_avg_sq,
                where + "null buffer pointer for a non-empty step");
        require(b.state != StateFormat::kQ8 || (b.exp_avg_scale && b.exp_avg_sq_scale),
                where + "int8 moments need both block-scale buffers");
    }
    for (double x : {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.grad_scale}) {
        require(std::isfinite(x), where + "hyper-parameters must be finite");
    }
}

bool same_hyper(const AdamHyper& a, const AdamHyper& b) {
    return a.step == b.step && a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 &&
           a.eps == b.eps && a.weight_decay == b.weight_decay && a.adamw == b.adamw &&
           a.grad_scale == b.grad_scale;
}

/// A byte range of one buffer of one tensor.
struct Span {
    uintptr_t begin;
    uintptr_t end;
    size_t tensor;
    const char* name;
    bool written;
};

/// Checks overlaps between the buffers of all tensors (pointer arithmetic
/// only). Throws if one tensor's own buffers overlap (the update would read
/// what it has just written); returns whether buffers of two different
/// tensors overlap in a way that makes the order of the updates matter.
bool check_overlaps(const std::vector<AdamBuffers>& buffers) {
    std::vector<Span> spans;
    spans.reserve(buffers.size() * 7);
    for (size_t t = 0; t < buffers.size(); ++t) {
        const AdamBuffers& b = buffers[t];
        if (b.n == 0) continue;
        const auto add_n = [&](const void* p, int64_t count, size_t elem, const char* name,
                               bool written) {
            const auto begin = reinterpret_cast<uintptr_t>(p);
            spans.push_back({begin, begin + static_cast<uintptr_t>(count) * elem, t, name, written});
        };
        const auto add = [&](const void* p, size_t elem, const char* name, bool written) {
            add_n(p, b.n, elem, name, written);
        };
        add(b.param, 4, "master", true);
        add(b.grad, simd::dtype_bytes(b.grad_dtype), "grad", false);
        add(b.exp_avg, simd::state_bytes(b.state), "exp_avg", true);
        add(b.exp_avg_sq, simd::state_bytes(b.state), "exp_avg_sq", true);
        if (b.state == StateFormat::kQ8) {
            const int64_t blocks = (b.n + kQBlock - 1) / kQBlock;
            add_n(b.exp_avg_scale, blocks, 4, "exp_avg_scale", true);
            add_n(b.exp_avg_sq_scale, blocks, 4, "exp_avg_sq_scale", true);
        }
        if (b.out16) add(b.out16, 2, "out16", true);
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
        return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
    });
    bool cross = false;
    // Each span against the following ones that start before it ends.
    for (size_t i = 0; i < spans.size(); ++i) {
        for (size_t j = i + 1; j < spans.size() && spans[j].begin < spans[i].end; ++j) {
            const Span& a = spans[i];
            const Span& b = spans[j];
            if (a.tensor == b.tensor) {
                throw_error<std::invalid_argument>("tensor " + std::to_string(a.tensor) + ": " +
                                                   a.name + " and " + b.name +
                                                   " overlap in memory");
            }
            cross = cross || a.written || b.written;
        }
    }
    return cross;
}

/// Runs the planned update of `buffers` on the compute pool.
void run(const std::vector<AdamBuffers>& buffers, const std::vector<AdamCoeffs>& coeffs) {
    const RangeFn kernel = adam_range_fn(simd::active_isa());
    std::vector<int64_t> sizes(buffers.size());
    for (size_t t = 0; t < buffers.size(); ++t) sizes[t] = buffers[t].n;
    simd::run_segments_on_pool(sizes, [&](int64_t t, int64_t begin, int64_t end) {
        kernel(buffers[t], coeffs[t], begin, end);
    });
}

}  // namespace

RangeFn adam_range_fn(simd::Isa isa) {
    switch (isa) {
#if defined(__x86_64__)
        case simd::Isa::kAvx512: return adam_range_avx512;
        case simd::Isa::kAvx2: return adam_range_avx2;
#endif
        default: return adam_range_scalar;
    }
}

void adam_step(const AdamBuffers& b, const AdamHyper& h) {
    validate(b, h, "adam_step: ");
    check_overlaps({b});
    if (b.n == 0) return;
    run({b}, {make_coeffs(h)});
}

void adam_step_many(const std::vector<AdamBuffers>& buffers, const std::vector<AdamHyper>& hypers) {
    require(buffers.size() == hypers.size(), "adam_step_many: one AdamHyper per tensor");
    std::vector<AdamCoeffs> coeffs(buffers.size());
    for (size_t t = 0; t < buffers.size(); ++t) {
        validate(buffers[t], hypers[t], "adam_step_many: tensor " + std::to_string(t) + ": ");
        // NOTE: usually every tensor has the same hyper-parameters and step;
        // reuse the coefficients instead of three pow() calls per tensor.
        const bool same = t > 0 && same_hyper(hypers[t], hypers[t - 1]);
        coeffs[t] = same ? coeffs[t - 1] : make_coeffs(hypers[t]);
    }
    if (check_overlaps(buffers)) {
        for (size_t t = 0; t < buffers.size(); ++t) run({buffers[t]}, {coeffs[t]});
        return;
    }
    run(buffers, coeffs);
}

}  // namespace infinity::adam
