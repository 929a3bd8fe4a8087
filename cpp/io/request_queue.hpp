// The FIFO of requests shared by an engine's workers. Workers take pieces
// (block_size slices) off the front request, so one large request spreads over
// every worker and the pieces go to the file in offset order. Injected faults
// and delays are applied here, where pieces are handed out in a total order.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>

#include "io/request.hpp"

namespace infinity::io {

/// A slice of a request in a worker's slot. buf/offset/len are the part still
/// to transfer (they advance on a short transfer); `transferred` is what moved.
struct Piece {
    RequestPtr req;
    char* buf = nullptr;
    std::uint64_t offset = 0;
    std::uint64_t len = 0;
    std::uint64_t transferred = 0;
    int inject_errno = 0;       // nonzero: fail with this errno instead of submitting
    bool inject_short = false;  // submit only about half, to exercise short-transfer handling
    int retries = 0;       // EINTR/EAGAIN resubmissions so far
};

class RequestQueue {
  public:
    explicit RequestQueue(std::uint64_t block_size) : block_size_(block_size) {}

    /// Appends a request (completing a zero-byte one at once). Throws
    /// std::runtime_error if the queue is closed.
    void push(const RequestPtr& request);

    enum class Take { Got, Empty, Later, Closed };
    /// Hands out the next piece into `out` (Got). Empty: nothing queued now.
    /// Later: the front request is delayed until `later`. Closed: closed and
    /// nothing left, the worker may exit once its own pieces are done.
    Take take(Piece& out, Clock::time_point now, Clock::time_point& later);

    /// Refuses new requests; queued ones are still handed out (drained).
    void close();

    /// A piece handed out by take() has finished (transferred, failed or
    /// dropped): every Got is matched by exactly one call. Never throws.
    void piece_done() noexcept;
    /// Seconds so far during which at least one piece was handed out and not
    /// finished (any worker): the time the disk had work from this engine.
    double busy_seconds();

    /// Fails the `nth` piece (per_request=false) or the first piece of the
    /// `nth` request (per_request=true) handed out from now on with `err`.
    /// nth == 0 disarms. One shot.
    void inject_fault(std::uint64_t nth, int err, bool per_request);
    /// The `nth` piece handed out from now on is submitted with about half its
    /// length (whole 4 KiB blocks, if it has more than one), so the kernel
    /// returns a short transfer the worker must continue. nth == 0 disarms.
    void inject_short_transfer(std::uint64_t nth);
    /// Every request pushed from now on starts no earlier than `delay` after its push.
    void inject_delay(std::chrono::microseconds delay);
    /// The `nth` batch submission to the kernel from now on (any worker) fails
    /// as if the submitting system call returned `err`. nth == 0 disarms.
    void inject_submit_error(std::uint64_t nth, int err);
    /// Called by a worker before each batch submission: the errno to fail it
    /// with (the injected one, when its turn has come), else 0.
    int take_submit_fault();
    /// The next `count` checks of take_worker_failure() (any worker) say yes:
    /// the worker then fails internally, as on a bug or out of memory.
    void inject_worker_failure(int count);
    bool take_worker_failure();

  private:
    std::mutex mu_;
    std::deque<RequestPtr> queue_;
    bool closed_ = false;
    const std::uint64_t block_size_;
    std::uint64_t piece_fault_countdown_ = 0;
    int piece_fault_errno_ = 0;
    std::uint64_t request_fault_countdown_ = 0;
    int request_fault_errno_ = 0;
    std::uint64_t short_countdown_ = 0;
    std::uint64_t submit_fault_countdown_ = 0;
    int submit_fault_errno_ = 0;
    int worker_failures_ = 0;
    std::chrono::microseconds delay_{0};
    // The busy clock: pieces out of take() and not yet piece_done(); it runs
    // while there is at least one (a union over the workers, not a sum).
    std::uint64_t pieces_out_ = 0;
    Clock::time_point busy_since_{};
    Clock::duration busy_{0};
};

}  // namespace infinity::io
