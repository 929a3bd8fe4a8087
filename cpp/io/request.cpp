#include "io/request.hpp"

#include "common/error.hpp"

namespace infinity::io {

const char* op_name(Op op) noexcept { return op == Op::Read ? "read" : "write"; }

Request::Request(Op op_, char* buf_, std::uint64_t nbytes_, int fd_, std::uint64_t offset_,
                 std::string path_)
    : op(op_), buf(buf_), nbytes(nbytes_), fd(fd_), offset(offset_), path(std::move(path_)) {}

void Request::piece_started() {
    std::lock_guard<std::mutex> lock(mu_);
    ++active_;
}

void Request::piece_finished(std::uint64_t bytes) {
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    --active_;
    maybe_finish_locked();
}

void Request::all_issued() {
    std::lock_guard<std::mutex> lock(mu_);
    issued_all_ = true;
    maybe_finish_locked();
}

void Request::fail(int err, std::uint64_t piece_offset, std::uint64_t piece_len,
                   const std::string& detail) {
    std::string message = std::string(op_name(op)) + " of " + std::to_string(nbytes) +
                          " bytes at offset " + std::to_string(offset) + " of '" + path +
                          "' failed: " + errno_text(err) + " (errno " + std::to_string(err) +
                          "); failing piece: offset " + std::to_string(piece_offset) + ", " +
                          std::to_string(piece_len) + " bytes";
    if (!detail.empty()) message += "; " + detail;
    std::lock_guard<std::mutex> lock(mu_);
    if (err_ != 0) return;  // the first error is the cause; later ones are consequences
    err_ = err;
    message_ = std::move(message);
    failed_.store(true, std::memory_order_release);
}

void Request::fail_quietly(int err) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (err_ != 0) return;
    err_ = err;
    failed_.store(true, std::memory_order_release);
}

void Request::maybe_finish_locked() {
    if (issued_all_ && active_ == 0 && !done_.load(std::memory_order_relaxed)) {
        done_.store(true, std::memory_order_release);
        cv_.notify_all();
    }
}

void Request::wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_.load(std::memory_order_relaxed); });
}

bool Request::wait_for(std::chrono::nanoseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return done_.load(std::memory_order_relaxed); });
}

int Request::error_code() const {
    std::lock_guard<std::mutex> lock(mu_);
    return err_;
}

std::string Request::error_message() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (message_.empty() && err_ != 0) {  // failed quietly: the worker had no memory left
        return std::string(op_name(op)) + " of " + std::to_string(nbytes) + " bytes at offset " +
               std::to_string(offset) + " of '" + path + "' failed: " + errno_text(err_) +
               " (errno " + std::to_string(err_) + "); the I/O worker failed while draining";
    }
    return message_;
}

}  // namespace infinity::io
