// What the optimizer bindings (cpp/adam/bind_adam.cpp, cpp/lion/bind_lion.cpp,
// cpp/sgd/bind_sgd.cpp) share: buffer addresses from Python, the dtype and
// state-format codes Python passes (formats.hpp, exported as
// `_C.adam.dtype_codes`, `_C.adam.state_formats`), checked with an error that
// names the bad code, and the fields every kernel's buffers have (master,
// gradient, optional 16-bit copy, element count).
// See NOTE [raw pointers into native code].
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/error.hpp"
#include "simd/formats.hpp"

namespace infinity::bind {

template <class T>
T* as_ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

inline simd::DType to_dtype(int code, const char* what) {
    for (const simd::DTypeInfo& t : simd::kDTypes) {
        if (static_cast<int>(t.code) == code) return t.code;
    }
    throw_error<std::invalid_argument>(std::string(what) +
                                       ": dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
}

inline simd::StateFormat to_state(int code) {
    for (const simd::StateFormatInfo& f : simd::kStateFormats) {
        if (static_cast<int>(f.code) == code) return f.code;
    }
    throw_error<std::invalid_argument>("state_format code must be 0 (fp32), 1 (bf16) or 2 (int8)");
}

/// `n`, an element count of entry point `fn`, if it is >= 0; std::invalid_argument
/// "<fn>: n must be >= 0" otherwise. The location is the caller's (see NOTE
/// [errors name their source line]).
inline int64_t to_count(int64_t n, const char* fn, SourceLocation where = SourceLocation()) {
    if (n < 0) throw_error<std::invalid_argument>(std::string(fn) + ": n must be >= 0", where);
    return n;
}

/// The buffers of one step of a kernel (adam::AdamBuffers, lion::LionBuffers,
/// sgd::SgdBuffers) with the fields they all have set from Python's arguments:
/// the fp32 master, the gradient and its dtype code, the optional 16-bit copy
/// (address 0: none; its dtype code is only read otherwise) and the element
/// count; the kernel's own fields keep their defaults. A bad code throws
/// std::invalid_argument naming the buffer; the count and the addresses are
/// the kernel's to check (its *_step validates before touching memory).
template <class Buffers>
Buffers flat_buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t out16,
                     int out_dtype, int64_t n) {
    Buffers b;
    b.param = as_ptr<float>(param);
    b.grad = as_ptr<const void>(grad);
    b.grad_dtype = to_dtype(grad_dtype, "grad");
    b.out16 = as_ptr<void>(out16);
    if (out16 != 0) b.out_dtype = to_dtype(out_dtype, "out16");
    b.n = n;
    return b;
}

}  // namespace infinity::bind
