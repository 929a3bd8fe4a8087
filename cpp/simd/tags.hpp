// Tag types naming the element type of a buffer in the CPU optimizer kernels'
// templates (Adam: cpp/adam/adam_math.hpp, Lion: cpp/lion/lion_math.hpp, SGD:
// cpp/sgd/sgd_math.hpp) and their "Ops" backends (ops_scalar.hpp,
// ops_avx2.hpp, ops_avx512.hpp).
#pragma once

#include <cstdint>

namespace infinity::simd {

struct F32Tag {
    using Storage = float;
};
struct BF16Tag {
    using Storage = uint16_t;
};
struct F16Tag {
    using Storage = uint16_t;
};
struct NoOutTag {
    using Storage = uint16_t;
};

}  // namespace infinity::simd
