// Linux native AIO backend over the raw system calls (no libaio): one
// aio_context per worker, one preallocated iocb per slot, completions
// signalled on an eventfd (IOCB_FLAG_RESFD).
#include <linux/aio_abi.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "io/backend.hpp"

namespace infinity::io {
namespace {

/// RAII owner of an aio_context_t.
class AioContext {
  public:
    explicit AioContext(unsigned nr_events) {
        if (::syscall(__NR_io_setup, nr_events, &ctx_) < 0) {
            throw_errno("io_setup(" + std::to_string(nr_events) +
                        " events; see /proc/sys/fs/aio-max-nr)");
        }
    }
    AioContext(const AioContext&) = delete;
    AioContext& operator=(const AioContext&) = delete;
    // NOTE: io_destroy waits for every transfer still in flight, so even an
    // abnormal teardown never lets the kernel write into freed memory.
    ~AioContext() { ::syscall(__NR_io_destroy, ctx_); }
    aio_context_t get() const noexcept { return ctx_; }

  private:
    aio_context_t ctx_ = 0;
};

class AioBackend final : public Backend {
  public:
    explicit AioBackend(std::uint32_t depth) : ctx_(depth), iocbs_(depth), events_(depth) {
        int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (efd < 0) throw_errno("eventfd for AIO completions");
        event_fd_.reset(efd);
        staged_.reserve(depth);
    }

    const char* name() const noexcept override { return "aio"; }

    void prepare(std::uint32_t slot, Op op, int fd, char* buf, std::uint32_t len,
                 std::uint64_t offset) override {
        iocb& cb = iocbs_[slot];
        std::memset(&cb, 0, sizeof cb);
        cb.aio_data = slot;
        cb.aio_lio_opcode = op == Op::Read ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
        cb.aio_fildes = static_cast<std::uint32_t>(fd);
        cb.aio_buf = reinterpret_cast<std::uint64_t>(buf);
        cb.aio_nbytes = len;
        cb.aio_offset = static_cast<std::int64_t>(offset);
        cb.aio_flags = IOCB_FLAG_RESFD;
        cb.aio_resfd = static_cast<std::uint32_t>(event_fd_.get());
        staged_.push_back(&cb);
    }

    std::size_t staged() const noexcept override { return staged_.size() - first_; }

    std::size_t submit(std::vector<Completion>& refused) override {
        std::size_t accepted = 0;
        while (first_ < staged_.size()) {
            long n = static_cast<long>(staged_.size() - first_);
            const int injected = take_injected_submit_errno();
            long r = injected ? (errno = injected, -1)
                              : ::syscall(__NR_io_submit, ctx_.get(), n, staged_.data() + first_);
            if (r > 0) {  // possibly fewer than n: the rest is retried below
                first_ += static_cast<std::size_t>(r);
                accepted += static_cast<std::size_t>(r);
                continue;
            }
            int err = r == 0 ? EAGAIN : errno;
            if (err == EINTR) continue;
            if (err == EAGAIN) break;  // out of resources: retry after reaping
            // io_submit reports an error only for the first iocb it could not
            // queue (bad fd, bad buffer, ...): fail that one and go on.
            refused.push_back({static_cast<std::uint32_t>(staged_[first_]->aio_data), -err});
            ++first_;
        }
        if (first_ == staged_.size()) {
            staged_.clear();
            first_ = 0;
        }
        return accepted;
    }

    void cancel_staged(std::vector<Completion>& out, int err) override {
        for (std::size_t i = first_; i < staged_.size(); ++i) {
            out.push_back({static_cast<std::uint32_t>(staged_[i]->aio_data), -err});
        }
        staged_.clear();
        first_ = 0;
    }

    int completion_fd() const noexcept override { return event_fd_.get(); }

    std::size_t reap(std::vector<Completion>& out) override {
        std::size_t total = 0;
        for (;;) {
            timespec zero{0, 0};
            long n = ::syscall(__NR_io_getevents, ctx_.get(), 0L,
                               static_cast<long>(events_.size()), events_.data(), &zero);
            if (n < 0) {
                if (errno == EINTR) continue;
                // Only a broken context can fail here; the transfers are
                // still tracked by the worker and io_destroy will wait them.
                throw_errno("io_getevents");
            }
            for (long i = 0; i < n; ++i) {
                out.push_back({static_cast<std::uint32_t>(events_[i].data), events_[i].res});
            }
            total += static_cast<std::size_t>(n);
            if (static_cast<std::size_t>(n) < events_.size()) return total;
        }
    }

  private:
    UniqueFd event_fd_;
    AioContext ctx_;  // destroyed before event_fd_: waits in-flight transfers first
    std::vector<iocb> iocbs_;
    std::vector<io_event> events_;
    std::vector<iocb*> staged_;
    std::size_t first_ = 0;  // staged_[first_:] are not yet accepted
};

}  // namespace

std::unique_ptr<Backend> make_aio_backend(std::uint32_t depth) {
    return std::make_unique<AioBackend>(depth);
}

}  // namespace infinity::io
