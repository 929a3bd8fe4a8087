#include "simd/isa.hpp"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/error.hpp"

namespace infinity::simd {
namespace {

bool cpu_has(Isa isa) {
#if defined(__x86_64__)
    // NOTE: __builtin_cpu_supports also checks that the OS saves the wider
    // registers (XGETBV), so a CPU feature hidden by the kernel reads false.
    switch (isa) {
        case Isa::kAvx512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case Isa::kAvx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case Isa::kScalar:
            return true;
    }
    return false;
#else
    return isa == Isa::kScalar;
#endif
}

// -1: automatic; otherwise the forced Isa.
std::atomic<int> g_forced{-1};

}  // namespace

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::kAvx512: return "avx512";
        case Isa::kAvx2: return "avx2";
        case Isa::kScalar: return "scalar";
    }
    return "unknown";
}

std::vector<Isa> available_isas() {
    std::vector<Isa> out;
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
        if (cpu_has(isa)) out.push_back(isa);
    }
    return out;
}

namespace {

/// The automatic choice: the widest ISA, unless INFINITY_CPU_ISA names another
/// (an escape hatch for a CPU or hypervisor on which a kernel misbehaves; every
/// ISA stores the same bits, only speed differs).
Isa automatic_isa() {
    const std::vector<Isa> available = available_isas();
    const char* wanted = std::getenv("INFINITY_CPU_ISA");
    if (wanted == nullptr || *wanted == '\0') return available.front();
    std::string names;
    for (Isa isa : available) {
        if (std::string(wanted) == isa_name(isa)) return isa;
        names += names.empty() ? "" : ", ";
        names += isa_name(isa);
    }
    throw_error<std::invalid_argument>("INFINITY_CPU_ISA='" + std::string(wanted) +
                                       "' is not available on this CPU; use one of: " +
                                       names + " (or unset it for the widest)");
}

}  // namespace

Isa active_isa() {
    const int forced = g_forced.load(std::memory_order_relaxed);
    if (forced >= 0) return static_cast<Isa>(forced);
    static const Isa best = automatic_isa();
    return best;
}

void force_isa(const std::optional<std::string>& name) {
    if (!name) {
        g_forced.store(-1);
        return;
    }
    std::string names;
    for (Isa isa : available_isas()) {
        if (*name == isa_name(isa)) {
            g_forced.store(static_cast<int>(isa));
            return;
        }
        names += names.empty() ? "" : ", ";
        names += isa_name(isa);
    }
    throw_error<std::invalid_argument>("ISA '" + *name +
                                       "' is not available on this CPU; available: " + names);
}

}  // namespace infinity::simd
