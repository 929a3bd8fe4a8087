// The kernel's entry templates: adam_dispatch picks the instantiation of
// adam_loop (fp32 or bf16 moments) or q8::q8_loop (int8 moments) for a step's
// dtypes; adam_range is what each per-ISA entry point (adam_range_<isa>,
// cpp/simd/kernels_<isa>.cpp) runs. Included by those translation units inside
// their target regions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_math.hpp"
#include "adam/adam_q8.hpp"
#include "adam/adam_types.hpp"
#include "adam/kernels.hpp"
#include "simd/flat_dispatch.hpp"

namespace infinity::adam {

/// Dispatches on moment storage, grad dtype, output dtype and Adam/AdamW;
/// returns the index of the first element it did not process (int8: `end`).
template <class Ops>
inline __attribute__((always_inline)) int64_t adam_dispatch(const AdamBuffers& b,
                                                            const AdamCoeffs& c, int64_t begin,
                                                            int64_t end) {
    auto with_state = [&](auto grad_tag, auto out_tag, auto l2_tag, auto stream_tag) -> int64_t {
        using G = decltype(grad_tag);
        using O = decltype(out_tag);
        constexpr bool kL2 = decltype(l2_tag)::value;
        constexpr bool kStream = decltype(stream_tag)::value;
        switch (b.state) {
            case StateFormat::kF32: return adam_loop<Ops, G, O, F32Tag, kL2, kStream>(b, c, begin, end);
            case StateFormat::kBF16: return adam_loop<Ops, G, O, BF16Tag, kL2, kStream>(b, c, begin, end);
            case StateFormat::kQ8: return q8::q8_loop<Ops, G, O, kL2>(b, c, begin, end);
        }
        return begin;  // unreachable: formats are validated before any kernel runs
    };
    auto with_stream = [&](auto grad_tag, auto out_tag, auto l2_tag) -> int64_t {
        if constexpr (std::is_same_v<decltype(out_tag), NoOutTag>) {
            return with_state(grad_tag, out_tag, l2_tag, std::false_type{});
        } else {
            const bool stream = b.state != StateFormat::kQ8 && stream_out<Ops>(b, begin);
            return stream ? with_state(grad_tag, out_tag, l2_tag, std::true_type{})
                          : with_state(grad_tag, out_tag, l2_tag, std::false_type{});
        }
    };
    return simd::flat_dispatch(b, c.use_l2, begin, with_stream);
}

/// Updates elements [begin, end) of `b` over Ops. A vector Ops leaves the
/// elements after the last whole vector (a tensor's tail) to the scalar kernel.
template <class Ops>
inline __attribute__((always_inline)) void adam_range(const AdamBuffers& b, const AdamCoeffs& c,
                                                      int64_t begin, int64_t end) {
    [[maybe_unused]] const int64_t done = adam_dispatch<Ops>(b, c, begin, end);
    if constexpr (Ops::kWidth > 1) {
        // NOTE: streaming stores are weakly ordered; fence them before the task
        // reports completion to the thread that will read the output.
        Ops::stream_fence();
        if (done < end) adam_range_scalar(b, c, done, end);
    }
}

}  // namespace infinity::adam
