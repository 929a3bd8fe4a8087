// Errors that carry context: every failure names what was attempted, on what,
// the errno text where there is one, and the line of C++ that gave up, so a
// Python user sees the file, offset and reason, and a maintainer the place
// (an exception note: cpp/module.cpp).
// Throw through throw_error<E>() and throw_errno() (or SystemError), never a
// bare `throw std::...`: see NOTE [errors name their source line] (docs/NOTES.md).
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace infinity {

/// The file and line of a call site. The build is C++17 (no
/// std::source_location); GCC and Clang evaluate __builtin_FILE() and
/// __builtin_LINE() in a default argument at the caller, which is exactly what
/// std::source_location::current() does, and this also holds when a
/// SourceLocation parameter is itself defaulted (the location then is that of
/// the outermost call).
struct SourceLocation {
#if defined(__GNUC__) || defined(__clang__)
    constexpr SourceLocation(const char* f = __builtin_FILE(),
                             int l = __builtin_LINE()) noexcept
        : file(f), line(l) {}
#else
    constexpr SourceLocation(const char* f = "unknown", int l = 0) noexcept
        : file(f), line(l) {}
#endif
    const char* file;  // as given to the compiler: setup.py passes "cpp/<dir>/<name>.cpp"
    int line;

    /// " (cpp/io/engine.cpp:66)".
    std::string suffix() const {
        return " (" + std::string(file) + ":" + std::to_string(line) + ")";
    }
};

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

/// Where a native exception was thrown: a second base of the exceptions below,
/// read by the module's exception translator (cpp/module.cpp) and by
/// describe(). Kept out of what(): see NOTE [errors name their source line].
class ThrownAt {
  public:
    explicit ThrownAt(SourceLocation where) noexcept : where_(where) {}
    // NOTE: virtual, so dynamic_cast can cross from std::exception to here.
    virtual ~ThrownAt() = default;
    const SourceLocation& where() const noexcept { return where_; }

  private:
    SourceLocation where_;
};

/// The standard exception `E` (what pybind11 and callers catch) that also
/// records where it was thrown.
template <class E>
class Located final : public E, public ThrownAt {
  public:
    Located(const std::string& message, SourceLocation where) : E(message), ThrownAt(where) {}
};

/// An OS-level failure: `what()` is "<context>: <strerror(err)> (errno <err>)".
class SystemError : public std::runtime_error, public ThrownAt {
  public:
    SystemError(const std::string& context, int err, SourceLocation where = SourceLocation())
        : std::runtime_error(context + ": " + errno_text(err) + " (errno " + std::to_string(err) +
                             ")"),
          ThrownAt(where),
          errno_(err) {}
    /// The errno value of the failure.
    int code() const noexcept { return errno_; }

  private:
    int errno_;
};

/// Throws SystemError with the current errno.
[[noreturn]] inline void throw_errno(const std::string& context,
                                     SourceLocation where = SourceLocation()) {
    // NOTE: errno is read before anything else runs here: an allocation may change it.
    const int err = errno;
    throw SystemError(context, err, where);
}

/// Throws the standard exception `E` (default std::runtime_error) with
/// `message`, recording the caller's file and line.
template <class E = std::runtime_error>
[[noreturn]] void throw_error(const std::string& message, SourceLocation where = SourceLocation()) {
    static_assert(std::is_base_of_v<std::exception, E>, "throw_error throws std exceptions");
    throw Located<E>(message, where);
}

/// what(), plus " (<file>:<line>)" when the exception records where it was
/// thrown: for a message that leaves C++ as text rather than as an exception
/// (a request's error, a backend probe's reason).
inline std::string describe(const std::exception& e) {
    std::string text = e.what();
    if (const auto* at = dynamic_cast<const ThrownAt*>(&e)) text += at->where().suffix();
    return text;
}

}  // namespace infinity
