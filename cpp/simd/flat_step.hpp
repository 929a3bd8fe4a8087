// What the optimizer steps share (Adam: cpp/adam/adam_step.cpp, Lion:
// cpp/lion/lion_step.cpp, SGD: cpp/sgd/sgd_step.cpp): element sizes of the
// dtype and state-format codes, the check that a one-tensor step's buffers are
// disjoint, and the run of a range kernel over the compute pool with one task
// split (partition.hpp). The kernels' entry templates share their dtype
// dispatch too (flat_dispatch.hpp).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/thread_pool.hpp"
#include "simd/formats.hpp"
#include "simd/fp_env.hpp"
#include "simd/partition.hpp"

namespace infinity::simd {

/// Bytes of one element of a buffer of dtype `d` (a known code).
inline size_t dtype_bytes(DType d) { return d == DType::kF32 ? 4 : 2; }

/// Bytes of one element of a state in format `f`; 0 for an unknown code.
inline size_t state_bytes(StateFormat f) {
    for (const StateFormatInfo& info : kStateFormats) {
        if (info.code == f) return static_cast<size_t>(info.element_bytes);
    }
    return 0;
}

/// Whether `x` converts to a finite float. NOTE: converting a double beyond
/// the float range is undefined behaviour in C++, so a hyper-parameter must
/// pass this before make_*_coeffs rounds it.
inline bool fits_float(double x) { return std::isfinite(x) && std::fabs(x) <= FLT_MAX; }

/// The bytes [begin, end) of one named buffer.
struct BufferSpan {
    uintptr_t begin, end;
    const char* name;
};

/// The span of `count` elements of `elem` bytes at `p` (pointer arithmetic only).
inline BufferSpan buffer_span(const void* p, int64_t count, size_t elem, const char* name) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    return BufferSpan{at, at + static_cast<uintptr_t>(count) * elem, name};
}

/// "A and B overlap in memory" for the first two of `spans` that share a
/// byte, or "" if all are disjoint. A one-pass update reads and writes every
/// buffer element by element, so none may overlap another.
inline std::string find_overlap(std::vector<BufferSpan> spans) {
    std::sort(spans.begin(), spans.end(), [](const BufferSpan& x, const BufferSpan& y) {
        return std::tie(x.begin, x.end) < std::tie(y.begin, y.end);
    });
    for (size_t i = 1; i < spans.size(); ++i) {
        if (spans[i].begin < spans[i - 1].end) {
            return std::string(spans[i - 1].name) + " and " + spans[i].name + " overlap in memory";
        }
    }
    return "";
}

/// find_overlap over the buffers of one step `b` (lion::LionBuffers,
/// sgd::SgdBuffers): the fp32 master, the gradient, the kernel's own `states`
/// and, if given, the 16-bit copy. Pointer arithmetic only: nothing is read.
template <class Buffers>
std::string find_step_overlap(const Buffers& b, const std::vector<BufferSpan>& states) {
    std::vector<BufferSpan> spans = {buffer_span(b.param, b.n, 4, "master"),
                                     buffer_span(b.grad, b.n, dtype_bytes(b.grad_dtype), "grad")};
    spans.insert(spans.end(), states.begin(), states.end());
    if (b.out16 != nullptr) spans.push_back(buffer_span(b.out16, b.n, 2, "out16"));
    return find_overlap(std::move(spans));
}

/// Calls `kernel(tensor, begin, end)` over all elements of tensors of `sizes`
/// elements on the compute pool, split into tasks by plan_tasks: segments
/// start on kBlock boundaries, so an int8 block is one thread's and vectors
/// never straddle two tasks, and each element is updated by exactly one call.
/// Workers run with the caller's floating-point environment.
template <class Kernel>
void run_segments_on_pool(const std::vector<int64_t>& sizes, const Kernel& kernel) {
    const TaskPlan plan = plan_tasks(sizes, compute_threads());
    const auto run_task = [&](int64_t task) {
        for (size_t s = plan.offsets[task]; s < plan.offsets[task + 1]; ++s) {
            const Segment& seg = plan.segments[s];
            kernel(seg.tensor, seg.begin, seg.end);
        }
    };
    if (plan.num_tasks() <= 1) {
        if (plan.num_tasks() == 1) run_task(0);
        return;
    }
    const unsigned csr = current_fp_env();
    compute_pool()->run(static_cast<int64_t>(plan.num_tasks()), [&](int64_t task) {
        ScopedFpEnv env(csr);
        run_task(task);
    });
}

/// Runs `kernel(b, c, begin, end)` (a per-ISA range function) over all
/// `b.n` elements of a validated one-tensor step on the compute pool.
template <class Buffers, class Coeffs, class RangeFn>
void run_step_on_pool(const Buffers& b, const Coeffs& c, RangeFn kernel) {
    run_segments_on_pool({b.n}, [&](int64_t, int64_t begin, int64_t end) { kernel(b, c, begin, end); });
}

}  // namespace infinity::simd
