// Backend construction by name, and the run-time probe that decides which
// backends actually work here (a sandbox may forbid io_uring or AIO even when
// the headers and the kernel have them).
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <stdexcept>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/unique_fd.hpp"
#include "io/backend.hpp"
#include "io/limits.hpp"
#include "io/probe.hpp"

namespace infinity::io {

std::unique_ptr<Backend> make_uring_backend(std::uint32_t depth);
std::unique_ptr<Backend> make_aio_backend(std::uint32_t depth);
std::unique_ptr<Backend> make_threads_backend(std::uint32_t depth);

const std::vector<std::string>& backend_names() {
    // NOTE: preference order. io_uring first: it needs no per-request context
    // switch into a helper thread and batches submission and completion;
    // `infinity bench nvme` measures whether that holds on a given disk.
    static const std::vector<std::string> names{"io_uring", "aio", "threads"};
    return names;
}

std::unique_ptr<Backend> make_backend(const std::string& name, std::uint32_t depth) {
    if (name == "io_uring") return make_uring_backend(depth);
    if (name == "aio") return make_aio_backend(depth);
    if (name == "threads") return make_threads_backend(depth);
    throw_error<std::invalid_argument>("unknown I/O backend '" + name +
                                       "'; choose io_uring, aio or threads");
}

namespace {

constexpr std::size_t kProbeBytes = kAlignment;  // one O_DIRECT block

// Waits for one completion of `backend` for up to 2 s; returns its result.
std::int64_t await_one(Backend& backend, std::uint32_t slot) {
    std::vector<Completion> got;
    for (int round = 0; round < 200; ++round) {
        got.clear();
        backend.reap(got);
        for (const Completion& c : got) {
            if (c.slot == slot) return c.res;
        }
        pollfd pfd{backend.completion_fd(), POLLIN, 0};
        ::poll(&pfd, 1, 10);
        std::uint64_t counter;
        [[maybe_unused]] ssize_t r = ::read(backend.completion_fd(), &counter, sizeof counter);
    }
    return -ETIMEDOUT;
}

// One write and one read-back through the backend on an in-memory file.
std::string probe_one(const std::string& name) {
    try {
        // NOTE: declared before the backend so they outlive it: a backend's
        // destructor waits for transfers still in flight (e.g. after a timeout).
        UniqueFd fd(::memfd_create("infinity-io-probe", MFD_CLOEXEC));
        if (!fd.valid()) return "memfd_create: " + errno_text(errno);
        AlignedBuffer out = make_aligned_buffer(kProbeBytes, kAlignment);
        AlignedBuffer in = make_aligned_buffer(kProbeBytes, kAlignment);
        auto backend = make_backend(name, 2);
        for (std::size_t i = 0; i < kProbeBytes; ++i) out.get()[i] = static_cast<char>(i * 7 + 1);
        std::memset(in.get(), 0, kProbeBytes);

        std::vector<Completion> refused;
        backend->prepare(0, Op::Write, fd.get(), out.get(), kProbeBytes, 0);
        backend->submit(refused);
        std::int64_t res = refused.empty() ? await_one(*backend, 0) : refused[0].res;
        if (res != static_cast<std::int64_t>(kProbeBytes)) {
            return "test write returned " +
                   (res < 0 ? errno_text(static_cast<int>(-res)) : std::to_string(res));
        }
        backend->prepare(1, Op::Read, fd.get(), in.get(), kProbeBytes, 0);
        backend->submit(refused);
        res = refused.empty() ? await_one(*backend, 1) : refused[0].res;
        if (res != static_cast<std::int64_t>(kProbeBytes)) {
            return "test read returned " +
                   (res < 0 ? errno_text(static_cast<int>(-res)) : std::to_string(res));
        }
        if (std::memcmp(in.get(), out.get(), kProbeBytes) != 0) return "test read returned wrong data";
        return "";
    } catch (const std::exception& exc) {
        return describe(exc);
    }
}

}  // namespace

const std::map<std::string, std::string>& probe_results() {
    // Probed once per process; a function-local static is initialised thread-safely.
    static const std::map<std::string, std::string> results = [] {
        std::map<std::string, std::string> r;
        for (const auto& name : backend_names()) r[name] = probe_one(name);
        return r;
    }();
    return results;
}

std::vector<std::string> available_backends() {
    std::vector<std::string> names;
    for (const auto& name : backend_names()) {
        if (probe_results().at(name).empty()) names.push_back(name);
    }
    return names;
}

}  // namespace infinity::io
