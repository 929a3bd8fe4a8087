// An in-order host memory copy queue on one native thread: the CPU backend's
// stand-in for a GPU copy stream.
//
// This thread never touches Python: see NOTE [GIL and native threads]
// (docs/NOTES.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace infinity::devices {

/// Completion of one queued copy.
class CopyJob {
  public:
    CopyJob(char* dst, const char* src, std::uint64_t nbytes, std::chrono::microseconds delay)
        : dst(dst), src(src), nbytes(nbytes), delay(delay) {}
    CopyJob(const CopyJob&) = delete;
    CopyJob& operator=(const CopyJob&) = delete;

    char* const dst;
    const char* const src;
    const std::uint64_t nbytes;
    const std::chrono::microseconds delay;  // injected before the copy (tests)

    bool done() const noexcept { return done_.load(std::memory_order_acquire); }
    /// Blocks until done or `timeout` passes; returns done().
    bool wait_for(std::chrono::nanoseconds timeout);
    /// Marks the job complete and wakes its waiters (called by the worker).
    void finish();

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<bool> done_{false};
};

using CopyJobPtr = std::shared_ptr<CopyJob>;

/// Copies run one after another in submission order on a single thread.
class CopyQueue {
  public:
    CopyQueue();
    ~CopyQueue();
    CopyQueue(const CopyQueue&) = delete;
    CopyQueue& operator=(const CopyQueue&) = delete;

    /// Queue `memmove(dst, src, nbytes)`, after an injected `delay`.
    /// Throws std::invalid_argument on null pointers, std::runtime_error once
    /// closed or in a forked child.
    CopyJobPtr submit(char* dst, const char* src, std::uint64_t nbytes,
                      std::chrono::microseconds delay);
    /// Finish every queued copy, then stop the thread. Idempotent.
    void close();

  private:
    void run();

    mutable std::mutex mu_;  // guards jobs_ and closing_
    std::condition_variable wake_;
    std::deque<CopyJobPtr> jobs_;
    bool closing_ = false;
    std::mutex close_mu_;  // one close() at a time: the thread is joined once
    std::unique_ptr<std::thread> worker_;
    const int owner_pid_;
};

}  // namespace infinity::devices
