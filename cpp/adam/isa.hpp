// Run-time choice of the kernel: the widest instruction set the CPU (and OS)
// supports, unless a caller forces one (tests, benchmarks).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "adam/kernels.hpp"

namespace infinity::adam {

enum class Isa { kScalar, kAvx2, kAvx512 };

/// "scalar", "avx2" or "avx512".
const char* isa_name(Isa isa);

/// The ISAs this CPU can run, widest first; always ends with kScalar.
std::vector<Isa> available_isas();

/// The ISA the next step will use: the forced one if set, else the widest.
Isa active_isa();

/// Forces `name` (throws std::invalid_argument if unknown or unsupported
/// here); std::nullopt returns to automatic choice.
void force_isa(const std::optional<std::string>& name);

/// The kernel entry point of `isa`.
RangeFn range_fn(Isa isa);

}  // namespace infinity::adam
