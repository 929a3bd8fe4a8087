// One read or write of a contiguous buffer to a file range, and its
// completion handle. Workers split it into pieces; the request completes when
// every piece it handed out has finished and no more will be handed out.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace infinity::io {

using Clock = std::chrono::steady_clock;

enum class Op : std::uint8_t { Read, Write };

/// "read" or "write".
const char* op_name(Op op) noexcept;

class Request {
  public:
    Request(Op op, char* buf, std::uint64_t nbytes, int fd, std::uint64_t offset, std::string path);
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;

    // --- what to transfer (immutable) -------------------------------------
    const Op op;
    char* const buf;
    const std::uint64_t nbytes;
    const int fd;
    const std::uint64_t offset;
    const std::string path;  // only for error messages

    // --- scheduling state: touched only under the RequestQueue mutex -------
    std::uint64_t next = 0;           // bytes already handed out as pieces
    Clock::time_point ready_at{};     // injected delay: no piece starts before this
    int inject_errno = 0;             // injected request fault: its first piece fails

    // --- completion (called by workers) ------------------------------------
    /// A piece was handed out; must precede its piece_finished().
    void piece_started();
    /// A piece finished, successfully transferring `bytes` in total.
    void piece_finished(std::uint64_t bytes);
    /// No more pieces will be handed out (all handed out, or dropped after a failure).
    void all_issued();
    /// Records a failure (the first one wins). `piece_offset`/`piece_len`
    /// locate the failing piece; `detail` (may be empty) says more than errno.
    void fail(int err, std::uint64_t piece_offset, std::uint64_t piece_len,
              const std::string& detail);

    /// Like fail() but allocates nothing (for a worker out of memory): the
    /// message is then built when it is read (error_message()).
    void fail_quietly(int err) noexcept;

    /// True once failed: the remaining pieces are not handed out.
    bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

    // --- completion (called by users) ---------------------------------------
    bool done() const noexcept { return done_.load(std::memory_order_acquire); }
    std::uint64_t bytes_done() const noexcept { return bytes_.load(std::memory_order_relaxed); }
    /// Blocks until done.
    void wait();
    /// Blocks until done or `timeout` passes; returns done().
    bool wait_for(std::chrono::nanoseconds timeout);
    /// errno of the failure, 0 on success (meaningful once done()).
    int error_code() const;
    /// Message of the failure: op, path, offset, length and strerror.
    std::string error_message() const;

  private:
    void maybe_finish_locked();  // requires mu_

    mutable std::mutex mu_;
    std::condition_variable cv_;
    int active_ = 0;          // pieces handed out and not yet finished
    bool issued_all_ = false;
    int err_ = 0;
    std::string message_;
    std::atomic<bool> failed_{false};
    std::atomic<bool> done_{false};
    std::atomic<std::uint64_t> bytes_{0};
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace infinity::io
