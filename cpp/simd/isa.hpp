// Run-time choice of the kernels' instruction set: the widest the CPU (and OS)
// supports, unless a caller forces one (tests, benchmarks). One choice for every
// optimizer: each picks its entry point of the ISA (adam_range_fn, lion_range_fn,
// sgd_range_fn), so forcing one forces all.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace infinity::simd {

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

}  // namespace infinity::simd
