// One fused Adam/AdamW step over flat buffers, spread over the compute pool.
#pragma once

#include "adam/adam_types.hpp"

namespace infinity::adam {

/// Validates `b` and `h` (throws std::invalid_argument), then updates all
/// `b.n` elements with the active ISA on the compute pool. The result is
/// bitwise independent of the thread count and of the ISA.
void adam_step(const AdamBuffers& b, const AdamHyper& h);

}  // namespace infinity::adam
