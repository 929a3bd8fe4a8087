// The fused Lion step over flat buffers, spread over the compute pool.
#pragma once

#include "lion/lion_types.hpp"

namespace infinity::lion {

/// Validates `b` and `h` (throws std::invalid_argument), then updates all
/// `b.n` elements with the active ISA on the compute pool (every optimizer's
/// pool and task split: simd/flat_step.hpp). The result is bitwise independent of the thread
/// count and of the ISA.
void lion_step(const LionBuffers& b, const LionHyper& h);

}  // namespace infinity::lion
