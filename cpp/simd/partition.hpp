// Splitting the elements of one or more tensors into tasks for the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "simd/formats.hpp"

namespace infinity::simd {

/// Segments start at multiples of this many elements within their tensor: a
/// multiple of the widest vector (16 floats), so scalar code only ever runs
/// on a tensor's own tail, of a cache line in every buffer (64 floats =
/// 256 B, 64 bytes of int8 codes), so two threads never write the same line,
/// and of the int8 quantisation block (kQBlock), so a block is one thread's.
constexpr int64_t kBlock = 256;
static_assert(kBlock % kQBlock == 0, "a thread's segment must hold whole quantisation blocks");

/// Elements [begin, end) of tensor `tensor`.
struct Segment {
    int64_t tensor;
    int64_t begin;
    int64_t end;
};

/// Tasks of one step: task t is segments[offsets[t] .. offsets[t + 1]).
struct TaskPlan {
    std::vector<Segment> segments;
    std::vector<std::size_t> offsets;

    std::size_t num_tasks() const { return offsets.empty() ? 0 : offsets.size() - 1; }
};

/// Plans tasks of about equal size over tensors of `sizes` elements for
/// `threads` threads: a few tasks per thread (claimed dynamically, so a core
/// busy with another process delays the step by one task at most), small
/// tensors packed together, large ones split on kBlock boundaries. Returns a
/// single task when splitting would cost more than it saves.
TaskPlan plan_tasks(const std::vector<int64_t>& sizes, int threads);

}  // namespace infinity::simd
