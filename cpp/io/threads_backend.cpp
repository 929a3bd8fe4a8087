// Portable backend: blocking pread/pwrite on a small pool of helper threads
// per worker. Works on any POSIX file system (and in sandboxes that forbid
// io_uring and AIO); the worker drives it exactly like the kernel queues.
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "common/error.hpp"
#include "common/quiet_thread.hpp"
#include "common/unique_fd.hpp"
#include "io/backend.hpp"

namespace infinity::io {
namespace {

// NOTE: a blocking helper per queue slot would mean thousands of threads at
// large queue depths; past a few dozen concurrent requests a single file
// gains nothing, so the pool is capped and deeper queues wait in `jobs_`.
constexpr std::uint32_t kMaxHelpers = 32;

struct Job {
    std::uint32_t slot;
    Op op;
    int fd;
    char* buf;
    std::uint32_t len;
    std::uint64_t offset;
};

std::int64_t run_job(const Job& job) {
    for (;;) {
        ssize_t r = job.op == Op::Read
                        ? ::pread(job.fd, job.buf, job.len, static_cast<off_t>(job.offset))
                        : ::pwrite(job.fd, job.buf, job.len, static_cast<off_t>(job.offset));
        if (r >= 0) return r;
        if (errno != EINTR) return -errno;
    }
}

class ThreadsBackend final : public Backend {
  public:
    explicit ThreadsBackend(std::uint32_t depth) {
        int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (efd < 0) throw_errno("eventfd for thread-pool completions");
        event_fd_.reset(efd);
        std::uint32_t n = std::min(depth, kMaxHelpers);
        try {
            for (std::uint32_t i = 0; i < n; ++i) {
                helpers_.push_back(start_quiet_thread("inf-io-helper", [this] { helper_loop(); }));
            }
        } catch (...) {
            stop_and_join();  // a std::thread left joinable would terminate()
            throw;
        }
    }

    ~ThreadsBackend() override { stop_and_join(); }

    const char* name() const noexcept override { return "threads"; }

    void prepare(std::uint32_t slot, Op op, int fd, char* buf, std::uint32_t len,
                 std::uint64_t offset) override {
        staged_.push_back({slot, op, fd, buf, len, offset});
    }

    std::size_t staged() const noexcept override { return staged_.size(); }

    std::size_t submit(std::vector<Completion>& /*refused*/) override {
        std::size_t n = staged_.size();
        if (n == 0) return 0;
        {
            std::lock_guard<std::mutex> lock(mu_);
            jobs_.insert(jobs_.end(), staged_.begin(), staged_.end());
        }
        staged_.clear();
        cv_.notify_all();
        return n;
    }

    void cancel_staged(std::vector<Completion>& out, int err) override {
        for (const Job& job : staged_) out.push_back({job.slot, -err});
        staged_.clear();
    }

    int completion_fd() const noexcept override { return event_fd_.get(); }

    std::size_t reap(std::vector<Completion>& out) override {
        std::lock_guard<std::mutex> lock(mu_);
        std::size_t n = done_.size();
        out.insert(out.end(), done_.begin(), done_.end());
        done_.clear();
        return n;
    }

  private:
    void helper_loop() {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            // Jobs still queued are finished even when stopping: nothing is dropped.
            cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
            if (jobs_.empty()) return;
            Job job = jobs_.front();
            jobs_.pop_front();
            lock.unlock();
            std::int64_t res = run_job(job);
            lock.lock();
            done_.push_back({job.slot, res});
            std::uint64_t one = 1;
            // Cannot fail short of a counter overflow (2^64-2 unread signals).
            [[maybe_unused]] ssize_t w = ::write(event_fd_.get(), &one, sizeof one);
        }
    }

    void stop_and_join() noexcept {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : helpers_) {
            if (t.joinable()) t.join();
        }
        helpers_.clear();
    }

    UniqueFd event_fd_;
    std::vector<Job> staged_;  // worker thread only
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> jobs_;
    std::vector<Completion> done_;
    bool stop_ = false;
    std::vector<std::thread> helpers_;
};

}  // namespace

std::unique_ptr<Backend> make_threads_backend(std::uint32_t depth) {
    return std::make_unique<ThreadsBackend>(depth);
}

}  // namespace infinity::io
