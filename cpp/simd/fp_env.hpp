// The floating-point environment (MXCSR) of the calling thread, carried over
// to the pool threads that work on its behalf.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace infinity::simd {

/// The caller's MXCSR (flush-to-zero, denormals-are-zero, rounding mode); 0 off x86.
inline unsigned current_fp_env() {
#if defined(__x86_64__)
    return _mm_getcsr();
#else
    return 0;
#endif
}

/// Sets the thread's MXCSR to `csr` for its lifetime, so a worker computes
/// exactly what the caller would (e.g. under torch.set_flush_denormal(True)).
class ScopedFpEnv {
  public:
    explicit ScopedFpEnv(unsigned csr) {
#if defined(__x86_64__)
        saved_ = _mm_getcsr();
        wanted_ = csr;
        if (saved_ != wanted_) _mm_setcsr(wanted_);
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

}  // namespace infinity::simd
