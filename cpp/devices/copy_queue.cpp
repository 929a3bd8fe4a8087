#include "devices/copy_queue.hpp"

#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/error.hpp"
#include "common/quiet_thread.hpp"

namespace infinity::devices {

bool CopyJob::wait_for(std::chrono::nanoseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return done(); });
}

void CopyJob::finish() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
}

CopyQueue::CopyQueue() : owner_pid_(::getpid()) {
    worker_ = std::make_unique<std::thread>(start_quiet_thread("inf-copy", [this] { run(); }));
}

CopyQueue::~CopyQueue() { close(); }

CopyJobPtr CopyQueue::submit(char* dst, const char* src, std::uint64_t nbytes,
                             std::chrono::microseconds delay) {
    if (nbytes > 0 && (dst == nullptr || src == nullptr)) {
        throw_error<std::invalid_argument>("copy of " + std::to_string(nbytes) +
                                           " bytes with a null buffer");
    }
    if (::getpid() != owner_pid_) {
        throw_error<std::runtime_error>(
            "this copy queue was created before fork(); its thread does not exist in the "
            "child process: create a new backend there");
    }
    auto job = std::make_shared<CopyJob>(dst, src, nbytes, delay);
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (closing_) throw_error<std::runtime_error>("the copy queue is closed");
        jobs_.push_back(job);
    }
    wake_.notify_one();
    return job;
}

void CopyQueue::run() {
    for (;;) {
        CopyJobPtr job;
        {
            std::unique_lock<std::mutex> lock(mu_);
            wake_.wait(lock, [this] { return closing_ || !jobs_.empty(); });
            if (jobs_.empty()) return;  // closing, and everything queued is done
            job = jobs_.front();
        }
        if (job->delay.count() > 0) std::this_thread::sleep_for(job->delay);
        if (job->nbytes > 0) std::memmove(job->dst, job->src, job->nbytes);
        {
            // NOTE: popped only after the copy, so close() sees it as queued.
            std::lock_guard<std::mutex> lock(mu_);
            jobs_.pop_front();
        }
        job->finish();
    }
}

void CopyQueue::close() {
    std::lock_guard<std::mutex> once(close_mu_);
    {
        std::lock_guard<std::mutex> lock(mu_);
        closing_ = true;
    }
    wake_.notify_all();
    if (!worker_) return;
    if (::getpid() != owner_pid_) {
        // Leak the handle: see NOTE [fork and native threads] (docs/NOTES.md).
        static_cast<void>(worker_.release());
        return;
    }
    worker_->join();
    worker_.reset();
}

}  // namespace infinity::devices
