// RAII owner of a file descriptor: closed exactly once, never leaked on an
// exception path, movable but not copyable (a copy would close twice).
#pragma once

#include <unistd.h>

#include <utility>

namespace infinity {

class UniqueFd {
  public:
    UniqueFd() noexcept = default;
    explicit UniqueFd(int fd) noexcept : fd_(fd) {}
    UniqueFd(const UniqueFd&) = delete;
    UniqueFd& operator=(const UniqueFd&) = delete;
    UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
    UniqueFd& operator=(UniqueFd&& other) noexcept {
        if (this != &other) reset(std::exchange(other.fd_, -1));
        return *this;
    }
    ~UniqueFd() { reset(); }

    int get() const noexcept { return fd_; }
    bool valid() const noexcept { return fd_ >= 0; }

    /// Closes the current descriptor (if any) and takes ownership of `fd`.
    void reset(int fd = -1) noexcept {
        // NOTE: close() errors are ignored on purpose: on Linux the descriptor
        // is released even when close() reports EINTR/EIO, and retrying could
        // close a descriptor another thread has just been handed.
        if (fd_ >= 0) ::close(fd_);
        fd_ = fd;
    }

  private:
    int fd_ = -1;
};

}  // namespace infinity
