// Errors that carry context: every failure names what was attempted, on what,
// and the errno text, so a Python user sees the file, offset and reason.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace infinity {

/// strerror() that is safe to call from several threads at once.
inline std::string errno_text(int err) {
    char buf[256];
    // NOTE: glibc's strerror_r is the GNU variant (returns the message pointer,
    // which may or may not be `buf`); the XSI variant returns an int. Handle both.
    auto result = strerror_r(err, buf, sizeof buf);
    if constexpr (std::is_same_v<decltype(result), char*>) {
        return std::string(result);
    } else {
        return result == 0 ? std::string(buf) : "Unknown error " + std::to_string(err);
    }
}

/// An OS-level failure: `what()` is "<context>: <strerror(err)> (errno <err>)".
class SystemError : public std::runtime_error {
  public:
    SystemError(const std::string& context, int err)
        : std::runtime_error(context + ": " + errno_text(err) + " (errno " + std::to_string(err) +
                             ")"),
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
