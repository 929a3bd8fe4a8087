// The kernel's entry template: picks the instantiation of adam_loop (fp32 or
// bf16 moments) or q8::q8_loop (int8 moments) for a step's dtypes. Included
// by each per-ISA kernel inside its target region.
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_math.hpp"
#include "adam/adam_types.hpp"
#include "adam/flat_dispatch.hpp"
#include "adam/q8_codec.hpp"

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
    return flat_dispatch(b, c.use_l2, begin, with_stream);
}

}  // namespace infinity::adam
