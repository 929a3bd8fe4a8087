// Memory-bandwidth probes for `infinity bench optim`: STREAM-style loops run on
// the same compute pool as the optimizer kernels, so "fraction of the roofline"
// compares like with like.
#include "simd/bandwidth.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/error.hpp"
#include "common/thread_pool.hpp"

namespace infinity::simd {
namespace {

constexpr int64_t kBlock = 1 << 16;  // elements per task (256 KiB per fp32 stream)

// NOTE: target_clones compiles one copy per ISA and picks at load time, so
// the probe is not held back by baseline SSE2 code on a wide machine.
__attribute__((target_clones("avx512f", "avx2", "default"))) void triad_range(
    float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
    int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void axpy_range(
    float* __restrict a, const float* __restrict b, float s, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] += s * b[i];
}

inline __attribute__((always_inline)) void adam_pattern_at(float* __restrict p,
                                                           const float* __restrict g,
                                                           float* __restrict m,
                                                           float* __restrict v, int64_t i) {
    const float x = g[i];
    p[i] += x;
    m[i] += x;
    v[i] += x;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void adam_pattern_range(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
    int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) adam_pattern_at(p, g, m, v, i);
}

// The same with the Adam kernel's software prefetch (see adam_loop, cpp/adam/adam_math.hpp), so the
// roofline is not held back by a trick only the kernel uses.
__attribute__((target_clones("avx512f", "avx2", "default"))) void adam_pattern_prefetch_range(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
    int64_t begin, int64_t end) {
    constexpr int64_t kLine = 16, kAhead = 256;
    int64_t i = begin;
    for (; i + kLine + kAhead <= end; i += kLine) {
        __builtin_prefetch(p + i + kAhead, 1, 3);
        __builtin_prefetch(g + i + kAhead, 0, 3);
        __builtin_prefetch(m + i + kAhead, 1, 3);
        __builtin_prefetch(v + i + kAhead, 1, 3);
        for (int64_t j = i; j < i + kLine; ++j) adam_pattern_at(p, g, m, v, j);
    }
    for (; i < end; ++i) adam_pattern_at(p, g, m, v, i);
}

template <class Fn>
void run_blocks(int64_t n, Fn&& fn) {
    const auto pool = compute_pool();
    const int64_t tasks = (n + kBlock - 1) / kBlock;
    pool->run(tasks, [&](int64_t t) { fn(t * kBlock, std::min(n, (t + 1) * kBlock)); });
}

}  // namespace

int64_t bandwidth_probe(BandwidthKernel kind, float* a, float* b, float* c, float* d, int64_t n) {
    if (n < 0) throw_error<std::invalid_argument>("bandwidth_probe: n must be >= 0");
    if (n > 0 && (!a || !b || (kind != BandwidthKernel::kAxpy && !c) ||
                  (kind >= BandwidthKernel::kAdamPattern && !d))) {
        throw_error<std::invalid_argument>("bandwidth_probe: null buffer pointer");
    }
    switch (kind) {
        case BandwidthKernel::kTriad:
            run_blocks(n, [&](int64_t lo, int64_t hi) { triad_range(a, b, c, 0.5f, lo, hi); });
            return n * 3 * int64_t{sizeof(float)};
        case BandwidthKernel::kAxpy:
            run_blocks(n, [&](int64_t lo, int64_t hi) { axpy_range(a, b, 0.5f, lo, hi); });
            return n * 3 * int64_t{sizeof(float)};
        case BandwidthKernel::kAdamPattern:
            run_blocks(n, [&](int64_t lo, int64_t hi) { adam_pattern_range(a, b, c, d, lo, hi); });
            return n * 7 * int64_t{sizeof(float)};
        case BandwidthKernel::kAdamPatternPrefetch:
            run_blocks(n, [&](int64_t lo, int64_t hi) {
                adam_pattern_prefetch_range(a, b, c, d, lo, hi);
            });
            return n * 7 * int64_t{sizeof(float)};
    }
    throw_error<std::invalid_argument>("bandwidth_probe: unknown kernel");
}

}  // namespace infinity::simd
