#include "simd/partition.hpp"

#include <algorithm>

namespace infinity::simd {
namespace {

// Below this many elements per thread, handing work to a worker costs more
// than it saves (a pool round trip is ~3 us, a thread updates ~1 element/ns).
constexpr int64_t kMinPerThread = int64_t{1} << 15;
constexpr int64_t kTasksPerThread = 4;

}  // namespace

TaskPlan plan_tasks(const std::vector<int64_t>& sizes, int threads) {
    TaskPlan plan;
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    plan.offsets.push_back(0);
    if (total == 0) return plan;

    int64_t wanted = 1;
    if (threads > 1 && total >= 2 * kMinPerThread) {
        wanted = std::min<int64_t>(int64_t{threads} * kTasksPerThread, total / kMinPerThread);
    }
    const int64_t target = ((total + wanted - 1) / wanted + kBlock - 1) / kBlock * kBlock;

    int64_t fill = 0;  // elements in the task being built
    auto close_task = [&] {
        if (plan.offsets.back() != plan.segments.size()) {
            plan.offsets.push_back(plan.segments.size());
        }
        fill = 0;
    };
    for (size_t t = 0; t < sizes.size(); ++t) {
        int64_t begin = 0;
        while (begin < sizes[t]) {
            int64_t len = sizes[t] - begin;
            const int64_t room = target - fill;
            if (len > room) {
                len = room / kBlock * kBlock;  // cut inside a tensor only on a block boundary
                if (len == 0) {
                    close_task();
                    continue;
                }
            }
            plan.segments.push_back({static_cast<int64_t>(t), begin, begin + len});
            begin += len;
            fill += len;
            if (fill + kBlock > target) close_task();
        }
    }
    close_task();
    return plan;
}

}  // namespace infinity::simd
