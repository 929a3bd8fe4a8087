// Errors that carry context: every failure names what was attempted, on what,
// and the errno text, so a Python user sees the file, offset and reason.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace infinity {

/// An OS-level failure: `what()` is "<context>: <strerror(err)> (errno <err>)".
class SystemError : public std::runtime_error {
  public:
    SystemError(const std::string& context, int err)
        : std::runtime_error(context + ": " + std::strerror(err) + " (errno " +
                             std::to_string(err) + ")"),
          errno_(err) {}
    /// The errno value of the failure.
    int code() const noexcept { return errno_; }

  private:
    int errno_;
};

/// Throws SystemError with the current errno.
[[noreturn]] inline void throw_errno(const std::string& context) {
    throw SystemError(context, errno);
}

}  // namespace infinity
