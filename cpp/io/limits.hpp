// The I/O contract shared with Python: the O_DIRECT alignment and the
// engine's limits, defined once here and exported as attributes of
// `infinity._C.io` (bind_io.cpp), which infinity/_native/io.py reads.
#pragma once

#include <cstdint>

namespace infinity::io {

/// O_DIRECT alignment of buffer addresses, file offsets and lengths.
/// See NOTE [O_DIRECT alignment] (docs/NOTES.md).
constexpr std::uint64_t kAlignment = 4096;
/// Largest piece: one system call moves at most ~2 GiB on Linux.
constexpr std::uint64_t kMaxBlockSize = 1ull << 30;
/// Most pieces in flight per worker (the size of its kernel queue).
constexpr std::uint32_t kMaxQueueDepth = 4096;
/// Most workers of one engine.
constexpr std::uint32_t kMaxThreads = 256;
/// Largest buffer io_uring registers (the kernel's limit; larger ones are
/// registered as several spans). See NOTE [registered buffers] (docs/NOTES.md).
constexpr std::uint64_t kMaxRegisteredBytes = 1ull << 30;

}  // namespace infinity::io
