// Fused Adam/AdamW steps over flat buffers, spread over the compute pool.
#pragma once

#include <vector>

#include "adam/adam_types.hpp"

namespace infinity::adam {

/// Validates `b` and `h` (throws std::invalid_argument), then updates all
/// `b.n` elements with the active ISA on the compute pool. The result is
/// bitwise independent of the thread count and of the ISA.
void adam_step(const AdamBuffers& b, const AdamHyper& h);

/// One step over several tensors in one pool dispatch (what torch calls a
/// multi-tensor or "fused" step): tensor i uses `buffers[i]` and `hypers[i]`.
/// Each tensor's result is bitwise that of `adam_step` on it alone. Throws
/// std::invalid_argument if a tensor's own buffers overlap. If buffers of
/// different tensors overlap (e.g. the same parameter twice), the tensors are
/// stepped one after the other in list order, as torch's per-tensor loop would.
void adam_step_many(const std::vector<AdamBuffers>& buffers, const std::vector<AdamHyper>& hypers);

}  // namespace infinity::adam
