// The asynchronous I/O engine: a request queue drained by `threads` workers,
// each with its own backend queue of `queue_depth` pieces of `block_size`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/limits.hpp"
#include "io/request_queue.hpp"
#include "io/worker.hpp"

namespace infinity::io {

struct EngineConfig {
    std::string backend;  // "io_uring", "aio" or "threads" (already resolved)
    std::uint64_t block_size = 1 << 20;
    std::uint32_t queue_depth = 32;
    std::uint32_t threads = 1;
};

class Engine {
  public:
    /// Throws std::invalid_argument for a bad config, SystemError if the
    /// kernel refuses the backend (e.g. io_uring_setup: EPERM in a sandbox).
    explicit Engine(EngineConfig config);
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;
    /// Closes: waits for every request in flight (never frees under the kernel).
    ~Engine();

    /// Queues a transfer of `nbytes` between `buf` and `fd` at `offset`.
    /// Throws std::invalid_argument on misalignment (no bounce buffers: see
    /// NOTE [O_DIRECT alignment]), std::runtime_error once closed.
    RequestPtr submit(Op op, char* buf, std::uint64_t nbytes, int fd, std::uint64_t offset,
                      std::string path);

    /// Registers buffers with every worker's kernel queue, so transfers inside
    /// them skip per-request page pinning (io_uring only). Returns 0, or the
    /// errno why a worker could not (the engine keeps working without them).
    /// The memory must outlive the engine. See NOTE [registered buffers] (docs/NOTES.md).
    int register_buffers(const std::vector<Region>& regions);
    /// Pieces transferred through registered buffers so far (all workers).
    std::uint64_t fixed_transfers() const;
    /// Seconds so far with at least one piece of a request in the workers' hands
    /// (submitted to the kernel or about to be): the time the disk had work.
    double busy_seconds() { return queue_.busy_seconds(); }

    /// Stops accepting requests, finishes every queued and in-flight one, joins
    /// the workers. Idempotent and thread-safe.
    void close();
    bool closed() const;

    void inject_fault(std::uint64_t nth, int err, bool per_request) {
        queue_.inject_fault(nth, err, per_request);
    }
    void inject_delay(std::chrono::microseconds delay) { queue_.inject_delay(delay); }
    void inject_short_transfer(std::uint64_t nth) { queue_.inject_short_transfer(nth); }
    void inject_submit_error(std::uint64_t nth, int err) { queue_.inject_submit_error(nth, err); }
    void inject_worker_failure(int count) {
        queue_.inject_worker_failure(count);
        for (auto& w : workers_) w->wake();
    }

    const EngineConfig& config() const noexcept { return config_; }

  private:
    const EngineConfig config_;
    RequestQueue queue_;
    std::vector<std::unique_ptr<Worker>> workers_;
    mutable std::mutex close_mu_;
    bool closed_ = false;
    const pid_t owner_pid_;  // See NOTE [fork and native threads] (docs/NOTES.md).
};

}  // namespace infinity::io
