#include "adam/adam_step.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "adam/isa.hpp"
#include "common/thread_pool.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace infinity::adam {
namespace {

// Thread ranges start on multiples of this many elements: a multiple of the
// widest vector (16 floats), so only the global tail ever runs scalar code,
// and of a cache line in every buffer (64 floats = 256 B, 64 halves = 128 B),
// so two threads never write the same line.
constexpr int64_t kBlock = 64;
// Below this many elements per thread, waking a worker costs more than the
// work it takes over (~10 us wake-up vs ~1.4 ns per element).
constexpr int64_t kMinPerThread = int64_t{1} << 15;
// Tasks per thread: a few, so a core shared with another process delays the
// step by the share of its last task only.
constexpr int64_t kTasksPerThread = 4;

/// Runs the task with the caller's MXCSR (flush-to-zero, denormals-are-zero,
/// rounding mode), so worker threads compute exactly what the caller would.
class ScopedFpEnv {
  public:
    explicit ScopedFpEnv(unsigned csr) {
#if defined(__x86_64__)
        saved_ = _mm_getcsr();
        if (saved_ != csr) _mm_setcsr(csr);
        wanted_ = csr;
#else
        (void)csr;
#endif
    }
    ~ScopedFpEnv() {
#if defined(__x86_64__)
        if (saved_ != wanted_) _mm_setcsr(saved_);
#endif
    }
    ScopedFpEnv(const ScopedFpEnv&) = delete;
    ScopedFpEnv& operator=(const ScopedFpEnv&) = delete;

  private:
    unsigned saved_ = 0;
    unsigned wanted_ = 0;
};

unsigned current_csr() {
#if defined(__x86_64__)
    return _mm_getcsr();
#else
    return 0;
#endif
}

void require(bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
}

bool valid_dtype(DType d) {
    return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

void validate(const AdamBuffers& b, const AdamHyper& h) {
    require(b.n >= 0, "adam_step: n must be >= 0");
    require(h.step >= 1, "adam_step: step must be >= 1 (the step count after the increment)");
    require(valid_dtype(b.grad_dtype), "adam_step: unknown grad dtype code");
    require(b.out16 == nullptr || b.out_dtype == DType::kBF16 || b.out_dtype == DType::kF16,
            "adam_step: out16 dtype must be bf16 or fp16");
    if (b.n > 0) {
        require(b.param && b.grad && b.exp_avg && b.exp_avg_sq,
                "adam_step: null buffer pointer for a non-empty step");
    }
    for (double x : {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.grad_scale}) {
        require(std::isfinite(x), "adam_step: hyper-parameters must be finite");
    }
}

}  // namespace

void adam_step(const AdamBuffers& b, const AdamHyper& h) {
    validate(b, h);
    if (b.n == 0) return;
    const AdamCoeffs c = make_coeffs(h);
    const RangeFn kernel = range_fn(active_isa());
    const int64_t n = b.n;

    const int threads = compute_threads();
    if (threads <= 1 || n < 2 * kMinPerThread) {
        kernel(b, c, 0, n);
        return;
    }
    const std::shared_ptr<ThreadPool> pool = compute_pool();
    const int64_t wanted = std::min<int64_t>(pool->num_threads() * kTasksPerThread,
                                             n / kMinPerThread);
    const int64_t per_task = (((n + wanted - 1) / wanted) + kBlock - 1) / kBlock * kBlock;
    const int64_t tasks = (n + per_task - 1) / per_task;
    const unsigned csr = current_csr();
    pool->run(tasks, [&](int64_t t) {
        ScopedFpEnv env(csr);
        const int64_t begin = t * per_task;
        kernel(b, c, begin, std::min(n, begin + per_task));
    });
}

}  // namespace infinity::adam
