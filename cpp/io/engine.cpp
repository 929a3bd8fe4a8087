#include "io/engine.hpp"

#include <unistd.h>

#include <stdexcept>

#include "common/error.hpp"

namespace infinity::io {
namespace {

EngineConfig checked(EngineConfig c) {
    if (c.block_size < kAlignment || c.block_size % kAlignment != 0 || c.block_size > kMaxBlockSize) {
        throw_error<std::invalid_argument>(
            "block_size=" + std::to_string(c.block_size) + " must be a multiple of " +
            std::to_string(kAlignment) + " bytes between " + std::to_string(kAlignment) + " and " +
            std::to_string(kMaxBlockSize >> 30) + " GiB");
    }
    if (c.queue_depth < 1 || c.queue_depth > kMaxQueueDepth) {
        throw_error<std::invalid_argument>("queue_depth=" + std::to_string(c.queue_depth) +
                                           " must be in 1.." + std::to_string(kMaxQueueDepth));
    }
    if (c.threads < 1 || c.threads > kMaxThreads) {
        throw_error<std::invalid_argument>("threads=" + std::to_string(c.threads) +
                                           " must be in 1.." + std::to_string(kMaxThreads));
    }
    return c;
}

}  // namespace

Engine::Engine(EngineConfig config)
    : config_(checked(std::move(config))), queue_(config_.block_size), owner_pid_(::getpid()) {
    // Build every backend before starting any thread, so a refusal (EPERM,
    // EAGAIN from aio-max-nr, ...) throws with nothing running to clean up.
    workers_.reserve(config_.threads);
    for (std::uint32_t i = 0; i < config_.threads; ++i) {
        workers_.push_back(std::make_unique<Worker>(
            queue_, make_backend(config_.backend, config_.queue_depth), config_.queue_depth));
    }
    try {
        for (auto& w : workers_) w->start();
    } catch (...) {
        close();  // joins the workers that did start
        throw;
    }
}

Engine::~Engine() { close(); }

RequestPtr Engine::submit(Op op, char* buf, std::uint64_t nbytes, int fd, std::uint64_t offset,
                          std::string path) {
    // The Python layer validates first and names the argument; these checks
    // keep the C++ API safe on its own.
    auto misaligned = [](const char* what, std::uint64_t v) {
        return std::string(what) + "=" + std::to_string(v) + " is not a multiple of " +
               std::to_string(kAlignment) + " (O_DIRECT alignment)";
    };
    if (reinterpret_cast<std::uintptr_t>(buf) % kAlignment) {
        throw_error<std::invalid_argument>(
            misaligned("buffer address", reinterpret_cast<std::uintptr_t>(buf)));
    }
    if (nbytes % kAlignment) throw_error<std::invalid_argument>(misaligned("nbytes", nbytes));
    if (offset % kAlignment) throw_error<std::invalid_argument>(misaligned("offset", offset));
    if (fd < 0) {
        throw_error<std::invalid_argument>("fd=" + std::to_string(fd) +
                                           " is not a file descriptor");
    }
    if (nbytes > 0 && buf == nullptr) throw_error<std::invalid_argument>("null buffer");
    if (offset > static_cast<std::uint64_t>(INT64_MAX) - nbytes) {
        throw_error<std::invalid_argument>("offset + nbytes overflows a file offset");
    }
    if (::getpid() != owner_pid_) {
        throw_error<std::runtime_error>(
            "this I/O engine was created before fork(); its workers do not exist in the "
            "child process: create a new engine there");
    }
    auto request = std::make_shared<Request>(op, buf, nbytes, fd, offset, std::move(path));
    queue_.push(request);
    for (auto& w : workers_) w->wake();
    return request;
}

int Engine::register_buffers(const std::vector<Region>& regions) {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) throw_error<std::runtime_error>("this I/O engine is closed");
    int first_error = 0;
    for (auto& w : workers_) {
        const int err = w->register_regions(regions);
        if (err != 0 && first_error == 0) first_error = err;
    }
    return first_error;
}

std::uint64_t Engine::fixed_transfers() const {
    std::lock_guard<std::mutex> lock(close_mu_);
    std::uint64_t total = 0;
    for (const auto& w : workers_) {
        if (w) total += w->fixed_transfers();
    }
    return total;
}

void Engine::close() {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) return;
    closed_ = true;
    if (::getpid() != owner_pid_) {
        // Leak the workers: see NOTE [fork and native threads] (docs/NOTES.md).
        for (auto& w : workers_) static_cast<void>(w.release());
        workers_.clear();
        return;
    }
    queue_.close();
    for (auto& w : workers_) w->wake();
    for (auto& w : workers_) w->join();
}

bool Engine::closed() const {
    std::lock_guard<std::mutex> lock(close_mu_);
    return closed_;
}

}  // namespace infinity::io
