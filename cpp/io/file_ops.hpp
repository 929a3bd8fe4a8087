// File-level helpers for swap files.
#pragma once

#include <cstdint>
#include <string>

namespace infinity::io {

/// Reserves `nbytes` from offset 0 of `fd` (fallocate, falling back to
/// posix_fallocate where the file system lacks it). Throws SystemError
/// naming `path` (ENOSPC when the disk is full).
void preallocate(int fd, std::uint64_t nbytes, const std::string& path);

}  // namespace infinity::io
