// The dispatch every optimizer kernel's entry template ends with (Adam:
// cpp/adam/adam_dispatch.hpp, Lion: cpp/lion/lion_math.hpp, SGD: cpp/sgd/sgd_math.hpp):
// from a step's run-time gradient dtype, 16-bit output dtype and one flag of the
// kernel's (Adam's L2 mode, Lion's and SGD's weight decay) to the tag types its
// loop templates take. Included through the math headers, inside each per-ISA
// kernel's target region, so it is compiled for that ISA.
#pragma once

#include <cstdint>
#include <type_traits>

#include "simd/formats.hpp"
#include "simd/tags.hpp"

namespace infinity::simd {

/// Calls `loop(grad_tag, out_tag, flag_tag)` with the tag of `b.grad_dtype`
/// (F32Tag, BF16Tag or F16Tag), the tag of the 16-bit copy (NoOutTag when
/// `b.out16` is null, else BF16Tag or F16Tag by `b.out_dtype`) and `flag` as
/// std::true_type or std::false_type, and returns what it returns: the index
/// of the first element the loop did not process. `b` is any kernel's buffers
/// (adam::AdamBuffers, lion::LionBuffers, sgd::SgdBuffers). An unknown grad dtype
/// returns `begin` (unreachable: every *_step validates the codes before any
/// kernel runs), so no element is touched.
template <class Buffers, class Loop>
inline __attribute__((always_inline)) int64_t flat_dispatch(const Buffers& b, bool flag,
                                                            int64_t begin, const Loop& loop) {
    auto with_out = [&](auto grad_tag, auto flag_tag) -> int64_t {
        if (b.out16 == nullptr) return loop(grad_tag, NoOutTag{}, flag_tag);
        if (b.out_dtype == DType::kBF16) return loop(grad_tag, BF16Tag{}, flag_tag);
        return loop(grad_tag, F16Tag{}, flag_tag);
    };
    auto with_grad = [&](auto flag_tag) -> int64_t {
        switch (b.grad_dtype) {
            case DType::kF32: return with_out(F32Tag{}, flag_tag);
            case DType::kBF16: return with_out(BF16Tag{}, flag_tag);
            case DType::kF16: return with_out(F16Tag{}, flag_tag);
        }
        return begin;  // unreachable: dtypes are validated before any kernel runs
    };
    if (flag) return with_grad(std::true_type{});
    return with_grad(std::false_type{});
}

}  // namespace infinity::simd
