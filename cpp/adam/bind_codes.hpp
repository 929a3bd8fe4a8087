// What the optimizer bindings (`bind_adam.cpp`, `bind_lion.cpp`, `bind_sgd.cpp`) share: buffer
// addresses from Python and the dtype and state-format codes Python passes
// (`_C.adam.dtype_codes`, `_C.adam.state_formats`), checked with an error that
// names the bad code. See NOTE [raw pointers into native code].
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam/adam_types.hpp"
#include "common/error.hpp"

namespace infinity::bind {

template <class T>
T* as_ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

inline adam::DType to_dtype(int code, const char* what) {
    for (const adam::DTypeInfo& t : adam::kDTypes) {
        if (static_cast<int>(t.code) == code) return t.code;
    }
    throw_error<std::invalid_argument>(std::string(what) +
                                       ": dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
}

inline adam::StateFormat to_state(int code) {
    for (const adam::StateFormatInfo& f : adam::kStateFormats) {
        if (static_cast<int>(f.code) == code) return f.code;
    }
    throw_error<std::invalid_argument>("state_format code must be 0 (fp32), 1 (bf16) or 2 (int8)");
}

}  // namespace infinity::bind
