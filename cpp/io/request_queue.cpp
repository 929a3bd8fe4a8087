#include "io/request_queue.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/error.hpp"

namespace infinity::io {

void RequestQueue::push(const RequestPtr& request) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw_error<std::runtime_error>("the I/O engine is closed; create a new IOEngine");
    if (request_fault_countdown_ > 0 && --request_fault_countdown_ == 0) {
        request->inject_errno = request_fault_errno_;
    }
    request->ready_at = Clock::now() + delay_;
    if (request->nbytes == 0) {
        request->all_issued();  // nothing to transfer: done at once
        return;
    }
    queue_.push_back(request);
}

RequestQueue::Take RequestQueue::take(Piece& out, Clock::time_point now, Clock::time_point& later) {
    std::lock_guard<std::mutex> lock(mu_);
    while (!queue_.empty()) {
        RequestPtr request = queue_.front();
        if (request->failed()) {
            // A failed request hands out nothing more; it completes when the
            // pieces already in flight come back.
            queue_.pop_front();
            request->all_issued();
            continue;
        }
        if (request->ready_at > now) {
            later = request->ready_at;
            return Take::Later;
        }
        std::uint64_t len = std::min(block_size_, request->nbytes - request->next);
        out.buf = request->buf + request->next;
        out.offset = request->offset + request->next;
        out.len = len;
        out.transferred = 0;
        out.retries = 0;
        out.inject_errno = request->next == 0 ? request->inject_errno : 0;
        if (piece_fault_countdown_ > 0 && --piece_fault_countdown_ == 0) {
            out.inject_errno = piece_fault_errno_;
        }
        out.inject_short = short_countdown_ > 0 && --short_countdown_ == 0;
        request->piece_started();  // before all_issued(), so it cannot complete early
        if (pieces_out_++ == 0) busy_since_ = now;
        request->next += len;
        if (request->next == request->nbytes) {
            queue_.pop_front();
            request->all_issued();
        }
        out.req = std::move(request);
        return Take::Got;
    }
    return closed_ ? Take::Closed : Take::Empty;
}

void RequestQueue::piece_done() noexcept {
    // NOTE: std::mutex::lock throws only on a broken system; the clock is a
    // statistic, never worth failing (or leaking) a piece for.
    try {
        std::lock_guard<std::mutex> lock(mu_);
        if (pieces_out_ > 0 && --pieces_out_ == 0) busy_ += Clock::now() - busy_since_;
    } catch (...) {
    }
}

double RequestQueue::busy_seconds() {
    std::lock_guard<std::mutex> lock(mu_);
    Clock::duration busy = busy_;
    if (pieces_out_ > 0) busy += Clock::now() - busy_since_;
    return std::chrono::duration<double>(busy).count();
}

void RequestQueue::close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
}

void RequestQueue::inject_fault(std::uint64_t nth, int err, bool per_request) {
    std::lock_guard<std::mutex> lock(mu_);
    if (per_request) {
        request_fault_countdown_ = nth;
        request_fault_errno_ = err;
    } else {
        piece_fault_countdown_ = nth;
        piece_fault_errno_ = err;
    }
}

void RequestQueue::inject_short_transfer(std::uint64_t nth) {
    std::lock_guard<std::mutex> lock(mu_);
    short_countdown_ = nth;
}

void RequestQueue::inject_submit_error(std::uint64_t nth, int err) {
    std::lock_guard<std::mutex> lock(mu_);
    submit_fault_countdown_ = nth;
    submit_fault_errno_ = err;
}

int RequestQueue::take_submit_fault() {
    std::lock_guard<std::mutex> lock(mu_);
    if (submit_fault_countdown_ > 0 && --submit_fault_countdown_ == 0) return submit_fault_errno_;
    return 0;
}

void RequestQueue::inject_worker_failure(int count) {
    std::lock_guard<std::mutex> lock(mu_);
    worker_failures_ = std::max(count, 0);
}

bool RequestQueue::take_worker_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_failures_ == 0) return false;
    --worker_failures_;
    return true;
}

void RequestQueue::inject_delay(std::chrono::microseconds delay) {
    std::lock_guard<std::mutex> lock(mu_);
    delay_ = delay;
}

}  // namespace infinity::io
