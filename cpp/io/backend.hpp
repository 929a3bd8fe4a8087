// The interface every I/O backend implements: one submission/completion queue
// owned by one worker thread. The worker stages pieces in numbered slots,
// pushes them to the kernel (or to helper threads) and reaps completions.
// Backends only move bytes and report raw results; retries, short transfers,
// fault injection and request bookkeeping live in the worker, once for all.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/request.hpp"

namespace infinity::io {

/// A finished slot: `res` is bytes transferred (>= 0) or -errno.
struct Completion {
    std::uint32_t slot;
    std::int64_t res;
};

/// A memory region handed to the kernel once, for transfers without per-request
/// page pinning (io_uring fixed buffers).
struct Region {
    char* base;
    std::size_t len;
};

class Backend {
  public:
    virtual ~Backend() = default;

    /// "io_uring", "aio" or "threads".
    virtual const char* name() const noexcept = 0;

    /// Stages one transfer in `slot` (< depth). The worker never stages more
    /// than `depth` slots that are not yet completed, so this cannot overflow.
    virtual void prepare(std::uint32_t slot, Op op, int fd, char* buf, std::uint32_t len,
                         std::uint64_t offset) = 0;

    /// Hands staged transfers to the kernel. Returns how many were accepted;
    /// the rest stay staged for the next call (a partial submit is normal).
    /// A transfer the kernel refused outright is appended to `refused` as a
    /// completion with its -errno, so nothing is silently dropped.
    virtual std::size_t submit(std::vector<Completion>& refused) = 0;

    /// Takes back every staged transfer, reporting each as failed with `err`
    /// (used when the kernel keeps refusing them: EAGAIN for too long).
    virtual void cancel_staged(std::vector<Completion>& out, int err) = 0;

    /// Transfers staged and not yet accepted by submit().
    virtual std::size_t staged() const noexcept = 0;

    /// A descriptor that polls readable when completions may be ready.
    /// The worker drains it (read) *before* reaping, so none is missed.
    virtual int completion_fd() const noexcept = 0;

    /// Appends the completions ready now (never blocks); returns how many.
    virtual std::size_t reap(std::vector<Completion>& out) = 0;

    /// Registers `regions` with the kernel so transfers inside one skip per-request
    /// page pinning. Returns 0, or the errno why not (EOPNOTSUPP: this backend has
    /// no such thing; ENOMEM: over RLIMIT_MEMLOCK; EBUSY: already registered).
    /// Safe to call while the worker submits: the lookup table is swapped atomically.
    /// See NOTE [registered buffers] (docs/NOTES.md).
    virtual int register_regions(const std::vector<Region>& regions) {
        static_cast<void>(regions);
        return EOPNOTSUPP;
    }

    /// Transfers staged so far that used a registered region (any thread may ask).
    virtual std::uint64_t fixed_transfers() const noexcept { return 0; }

    /// Test hook (worker thread only): the next submit() behaves as if its
    /// system call failed with `err`, through the backend's real error path.
    /// Backends without a submitting system call ignore it.
    void fail_next_submit(int err) noexcept { injected_submit_errno_ = err; }

  protected:
    /// The injected submit errno (then cleared), or 0: call just before the system call.
    int take_injected_submit_errno() noexcept { return std::exchange(injected_submit_errno_, 0); }

  private:
    int injected_submit_errno_ = 0;
};

/// Builds a backend by name with `depth` slots; throws SystemError (with the
/// failing system call and errno) if the kernel refuses, invalid_argument for
/// an unknown name.
std::unique_ptr<Backend> make_backend(const std::string& name, std::uint32_t depth);

/// Backend names in order of preference.
const std::vector<std::string>& backend_names();

}  // namespace infinity::io
