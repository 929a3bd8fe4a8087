#include "lion/lion_step.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "adam/fp_env.hpp"
#include "adam/isa.hpp"
#include "adam/partition.hpp"
#include "common/error.hpp"
#include "common/thread_pool.hpp"
#include "lion/lion_kernels.hpp"

namespace infinity::lion {
namespace {

// The location is the caller's (see NOTE [errors name their source line]).
void require(bool ok, const std::string& message, SourceLocation where = SourceLocation()) {
    if (!ok) throw_error<std::invalid_argument>("lion_step: " + message, where);
}

size_t element_size(DType d) { return d == DType::kF32 ? 4 : 2; }

size_t state_size(StateFormat f) {
    for (const adam::StateFormatInfo& info : adam::kStateFormats) {
        if (info.code == f) return static_cast<size_t>(info.element_bytes);
    }
    return 0;
}

void validate(const LionBuffers& b, const LionHyper& h) {
    require(b.n >= 0, "n must be >= 0");
    require(h.step >= 1, "step must be >= 1 (the step count after the increment)");
    require(b.round_offset >= 0, "round_offset must be >= 0");
    require(adam::known_dtype(b.grad_dtype), "unknown grad dtype code");
    require(state_size(b.state) != 0, "unknown optimizer state format code");
    require(b.out16 == nullptr || adam::out16_dtype(b.out_dtype), "out16 dtype must be bf16 or fp16");
    for (double x : {h.lr, h.beta1, h.beta2, h.weight_decay, h.grad_scale}) {
        require(std::isfinite(x), "hyper-parameters must be finite");
    }
    if (b.n == 0) return;
    require(b.param && b.grad && b.exp_avg, "null buffer pointer for a non-empty step");
    require(b.state != StateFormat::kQ8 || b.exp_avg_scale, "int8 momentum needs its block scales");
    // NOTE: pointer arithmetic only (Python checked the same before calling):
    // the update reads and writes every buffer in one pass, so none may overlap.
    struct Range {
        uintptr_t begin, end;
        const char* name;
    };
    const auto range = [&](const void* p, int64_t count, size_t elem, const char* name) {
        const auto at = reinterpret_cast<uintptr_t>(p);
        return Range{at, at + static_cast<uintptr_t>(count) * elem, name};
    };
    std::vector<Range> ranges = {range(b.param, b.n, 4, "master"),
                                 range(b.grad, b.n, element_size(b.grad_dtype), "grad"),
                                 range(b.exp_avg, b.n, state_size(b.state), "exp_avg")};
    if (b.state == StateFormat::kQ8) {
        ranges.push_back(range(b.exp_avg_scale, (b.n + adam::kQBlock - 1) / adam::kQBlock, 4,
                               "exp_avg_scale"));
    }
    if (b.out16 != nullptr) ranges.push_back(range(b.out16, b.n, 2, "out16"));
    std::sort(ranges.begin(), ranges.end(),
              [](const Range& x, const Range& y) { return std::tie(x.begin, x.end) < std::tie(y.begin, y.end); });
    for (size_t i = 1; i < ranges.size(); ++i) {
        require(ranges[i].begin >= ranges[i - 1].end,
                std::string(ranges[i - 1].name) + " and " + ranges[i].name + " overlap in memory");
    }
}

}  // namespace

void lion_step(const LionBuffers& b, const LionHyper& h) {
    validate(b, h);
    if (b.n == 0) return;
    const LionCoeffs c = make_lion_coeffs(h);
    const LionRangeFn kernel = lion_range_fn(adam::active_isa());
    // NOTE: the Adam kernel's task split: segments start on kBlock boundaries,
    // so an int8 block is one thread's and vectors never straddle two tasks.
    const adam::TaskPlan plan = adam::plan_tasks({b.n}, compute_threads());
    const auto run_task = [&](int64_t task) {
        for (size_t s = plan.offsets[task]; s < plan.offsets[task + 1]; ++s) {
            kernel(b, c, plan.segments[s].begin, plan.segments[s].end);
        }
    };
    if (plan.num_tasks() <= 1) {
        if (plan.num_tasks() == 1) run_task(0);
        return;
    }
    const unsigned csr = adam::current_fp_env();
    compute_pool()->run(static_cast<int64_t>(plan.num_tasks()), [&](int64_t task) {
        adam::ScopedFpEnv env(csr);
        run_task(task);
    });
}

}  // namespace infinity::lion
