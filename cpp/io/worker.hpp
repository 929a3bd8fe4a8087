// One I/O worker: a thread that keeps its backend's queue full with pieces
// taken from the shared RequestQueue, and checks every completion (retrying
// EINTR/EAGAIN, continuing short transfers, failing the request otherwise).
#pragma once

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "common/unique_fd.hpp"
#include "io/backend.hpp"
#include "io/request_queue.hpp"

namespace infinity::io {

class Worker {
  public:
    Worker(RequestQueue& queue, std::unique_ptr<Backend> backend, std::uint32_t depth);
    Worker(const Worker&) = delete;
    Worker& operator=(const Worker&) = delete;
    /// Joins the thread (the queue must have been closed first).
    ~Worker();

    void start();
    /// Wakes the thread to look at the queue again (new work, close).
    void wake() noexcept;
    /// Waits for the thread to drain and exit (after the queue is closed),
    /// then releases the backend.
    void join() noexcept;
    /// See Backend::register_regions (0 or an errno).
    int register_regions(const std::vector<Region>& regions) {
        return backend_ ? backend_->register_regions(regions) : EBADF;
    }
    std::uint64_t fixed_transfers() const noexcept {
        return backend_ ? backend_->fixed_transfers() : 0;
    }

  private:
    void run() noexcept;
    void loop();
    void fill(bool& closed, Clock::time_point& later);
    void stage(std::uint32_t slot);
    void handle_done();
    void handle(const Completion& c);
    void fail_piece(std::uint32_t slot, int err, const std::string& detail);
    void finish_piece(std::uint32_t slot);
    void drain_after_crash(const std::string& what) noexcept;
    void drain_quietly() noexcept;
    std::uint32_t in_use() const noexcept {
        return depth_ - static_cast<std::uint32_t>(free_.size());
    }

    RequestQueue& queue_;
    std::unique_ptr<Backend> backend_;
    const std::uint32_t depth_;
    UniqueFd wake_fd_;
    std::vector<Piece> slots_;
    std::vector<std::uint32_t> free_;   // slots not holding a piece
    std::vector<std::uint32_t> retry_;  // slots to stage again (short transfer, EAGAIN)
    std::vector<Completion> done_;      // completions waiting to be handled
    std::vector<Completion> batch_;     // done_ being handled
    std::thread thread_;
};

}  // namespace infinity::io
