#include "io/worker.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <new>
#include <stdexcept>

#include "common/error.hpp"
#include "common/quiet_thread.hpp"
#include "io/limits.hpp"

namespace infinity::io {
namespace {

// EINTR/EAGAIN completions are resubmitted this many times before the request fails.
constexpr int kMaxRetries = 100;
// Consecutive 1 ms rounds in which the kernel refuses every submission (EAGAIN)
// with nothing of ours in flight before the staged pieces fail with EAGAIN.
constexpr int kMaxStuckRounds = 5000;

void drain_eventfd(int fd) noexcept {
    std::uint64_t counter;
    // Non-blocking: returns EAGAIN when there is nothing to drain.
    [[maybe_unused]] ssize_t r = ::read(fd, &counter, sizeof counter);
}

std::string eof_detail(int fd) {
    struct stat st;
    std::string size = ::fstat(fd, &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown size";
    return "read past end of file (the file has " + size + ")";
}

}  // namespace

Worker::Worker(RequestQueue& queue, std::unique_ptr<Backend> backend, std::uint32_t depth)
    : queue_(queue), backend_(std::move(backend)), depth_(depth), slots_(depth) {
    int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0) throw_errno("eventfd for I/O worker wake-ups");
    wake_fd_.reset(efd);
    free_.reserve(depth);
    for (std::uint32_t i = depth; i > 0; --i) free_.push_back(i - 1);
    retry_.reserve(depth);
    done_.reserve(2 * static_cast<std::size_t>(depth));
    batch_.reserve(2 * static_cast<std::size_t>(depth));
}

Worker::~Worker() { join(); }

void Worker::start() { thread_ = start_quiet_thread("inf-io", [this] { run(); }); }

void Worker::wake() noexcept {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd_.get(), &one, sizeof one);
}

void Worker::join() noexcept {
    if (thread_.joinable()) thread_.join();
    // The thread exits only with nothing in flight: release the kernel queue
    // (ring, AIO context) and helper threads now rather than when the Python
    // object is garbage collected.
    backend_.reset();
}

void Worker::run() noexcept {
    try {
        loop();
    } catch (const std::exception& exc) {
        drain_after_crash(describe(exc));  // with the line that threw, if it recorded one
    } catch (...) {
        drain_after_crash("unknown exception in I/O worker");
    }
}

void Worker::loop() {
    int stuck_rounds = 0;
    for (;;) {
        if (queue_.take_worker_failure()) {
            throw_error<std::runtime_error>("injected internal failure");  // test hook
        }
        bool closed = false;
        Clock::time_point later = Clock::time_point::max();
        fill(closed, later);

        std::size_t before = backend_->staged();
        if (before > 0) {
            if (const int err = queue_.take_submit_fault()) backend_->fail_next_submit(err);
            backend_->submit(done_);
        }
        bool refused_all = before > 0 && backend_->staged() == before;
        if (!done_.empty()) {  // injected faults, refused submissions: no waiting needed
            stuck_rounds = 0;
            handle_done();
            continue;
        }
        if (closed && in_use() == 0) return;

        int timeout_ms = -1;
        if (backend_->staged() > 0) {
            // The kernel refused submissions (EAGAIN). With transfers in flight a
            // completion will make room; with none, poll again shortly but give up eventually.
            timeout_ms = 1;
            if (refused_all && backend_->staged() == in_use() && ++stuck_rounds > kMaxStuckRounds) {
                backend_->cancel_staged(done_, EAGAIN);
                continue;
            }
        } else if (later != Clock::time_point::max()) {
            auto wait = std::chrono::ceil<std::chrono::milliseconds>(later - Clock::now());
            timeout_ms = static_cast<int>(std::clamp<long long>(wait.count(), 0, 60'000));
        }
        pollfd fds[2] = {{wake_fd_.get(), POLLIN, 0}, {backend_->completion_fd(), POLLIN, 0}};
        if (::poll(fds, 2, timeout_ms) <= 0) continue;  // timeout or EINTR: look again
        if (fds[0].revents != 0) drain_eventfd(wake_fd_.get());
        if (fds[1].revents != 0) {
            // NOTE: drain the completion eventfd *before* reaping: a completion
            // landing after the reap then leaves it readable for the next poll(),
            // so none is missed. (Only the syscalls of a wake-up are spent here,
            // which matters on a loaded machine: ~3 per wake-up, not ~8.)
            drain_eventfd(backend_->completion_fd());
            backend_->reap(done_);
        }
        if (!done_.empty()) {
            stuck_rounds = 0;
            handle_done();
        }
    }
}

void Worker::handle_done() {
    // Handling can append to done_ (never today, but keep it safe): swap first.
    batch_.swap(done_);
    for (const Completion& c : batch_) handle(c);
    batch_.clear();
}

void Worker::fill(bool& closed, Clock::time_point& later) {
    for (std::uint32_t slot : retry_) {
        if (slots_[slot].req->failed()) {
            finish_piece(slot);  // its request failed elsewhere: stop here
        } else {
            stage(slot);
        }
    }
    retry_.clear();
    while (!free_.empty()) {
        std::uint32_t slot = free_.back();
        Piece& piece = slots_[slot];
        auto got = queue_.take(piece, Clock::now(), later);
        if (got != RequestQueue::Take::Got) {
            closed = got == RequestQueue::Take::Closed;
            return;
        }
        free_.pop_back();
        if (piece.inject_errno != 0) {
            done_.push_back({slot, -piece.inject_errno});  // injected fault: never submitted
        } else {
            stage(slot);
        }
    }
}

void Worker::stage(std::uint32_t slot) {
    Piece& p = slots_[slot];
    std::uint64_t len = p.len;
    if (p.inject_short) {  // test hook: ask for less, as a real short transfer would give
        p.inject_short = false;
        if (len > kAlignment) len = std::max(kAlignment, len / 2 / kAlignment * kAlignment);
    }
    backend_->prepare(slot, p.req->op, p.req->fd, p.buf, static_cast<std::uint32_t>(len), p.offset);
}

void Worker::handle(const Completion& c) {
    Piece& p = slots_[c.slot];
    Request& request = *p.req;
    if (c.res < 0) {
        int err = static_cast<int>(-c.res);
        bool transient = err == EINTR || err == EAGAIN;
        if (transient && !request.failed() && p.retries < kMaxRetries) {
            ++p.retries;
            retry_.push_back(c.slot);
            return;
        }
        fail_piece(c.slot, err, transient ? "gave up after " + std::to_string(p.retries) + " retries" : "");
        return;
    }
    auto n = static_cast<std::uint64_t>(c.res);
    if (n > p.len) {
        fail_piece(c.slot, EIO,
                   "the kernel reported " + std::to_string(n) + " bytes for a " +
                       std::to_string(p.len) + "-byte transfer");
        return;
    }
    p.transferred += n;
    p.buf += n;
    p.offset += n;
    p.len -= n;
    if (p.len == 0 || request.failed()) {
        finish_piece(c.slot);
        return;
    }
    // A short transfer: continue from where it stopped, unless it cannot.
    if (request.op == Op::Read) {
        struct stat st;
        bool at_eof = n == 0 || (::fstat(request.fd, &st) == 0 &&
                                 p.offset >= static_cast<std::uint64_t>(st.st_size));
        if (at_eof) {
            fail_piece(c.slot, ENODATA, eof_detail(request.fd));
            return;
        }
    } else if (n == 0) {
        fail_piece(c.slot, EIO, "the write made no progress");
        return;
    }
    retry_.push_back(c.slot);
}

void Worker::fail_piece(std::uint32_t slot, int err, const std::string& detail) {
    const Piece& p = slots_[slot];
    p.req->fail(err, p.offset, p.len, detail);
    finish_piece(slot);
}

void Worker::finish_piece(std::uint32_t slot) {
    Piece& p = slots_[slot];
    RequestPtr request = std::move(p.req);
    p.req.reset();
    free_.push_back(slot);
    // The busy clock stops first: a waiter woken by the request sees it stopped.
    queue_.piece_done();
    request->piece_finished(p.transferred);
}

void Worker::drain_after_crash(const std::string& what) noexcept {
    // An internal error (not an I/O error of a request) broke this worker.
    // Destroying the backend first waits for transfers still in the kernel,
    // so no request completes while the kernel may still touch its buffer.
    std::string detail = "I/O worker failed: " + what;
    try {
        backend_.reset();
        if (queue_.take_worker_failure()) throw std::bad_alloc();  // test hook: fail again
        for (std::uint32_t slot = 0; slot < depth_; ++slot) {
            if (slots_[slot].req) fail_piece(slot, EIO, detail);
        }
        retry_.clear();
        // Fail whatever else this worker is handed until the engine closes,
        // so no waiter hangs on a piece nobody will run.
        for (;;) {
            Piece piece;
            Clock::time_point later = Clock::time_point::max();
            auto got = queue_.take(piece, Clock::now(), later);
            if (got == RequestQueue::Take::Closed) return;
            if (got == RequestQueue::Take::Got) {
                piece.req->fail(EIO, piece.offset, piece.len, detail);
                queue_.piece_done();
                piece.req->piece_finished(0);
                continue;
            }
            pollfd fd{wake_fd_.get(), POLLIN, 0};
            ::poll(&fd, 1, got == RequestQueue::Take::Later ? 1 : -1);
            drain_eventfd(wake_fd_.get());
        }
    } catch (...) {
        // A second failure (out of memory while failing requests): go on
        // failing them without allocating, so no waiter hangs on a piece
        // nobody will run and close() still finds this worker draining.
        drain_quietly();
    }
}

void Worker::drain_quietly() noexcept {
    for (std::uint32_t slot = 0; slot < depth_; ++slot) {
        Piece& p = slots_[slot];
        if (!p.req) continue;
        RequestPtr request = std::move(p.req);
        p.req.reset();
        request->fail_quietly(EIO);
        queue_.piece_done();
        request->piece_finished(0);
    }
    retry_.clear();
    for (;;) {
        Piece piece;
        Clock::time_point later = Clock::time_point::max();
        RequestQueue::Take got;
        try {
            got = queue_.take(piece, Clock::now(), later);
        } catch (...) {  // std::mutex::lock: only on a broken system
            got = RequestQueue::Take::Later;
        }
        if (got == RequestQueue::Take::Closed) return;
        if (got == RequestQueue::Take::Got) {
            piece.req->fail_quietly(EIO);
            queue_.piece_done();
            piece.req->piece_finished(0);
            continue;
        }
        pollfd fd{wake_fd_.get(), POLLIN, 0};
        ::poll(&fd, 1, got == RequestQueue::Take::Later ? 1 : -1);
        drain_eventfd(wake_fd_.get());
    }
}

}  // namespace infinity::io
