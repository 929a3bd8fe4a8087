// io_uring backend over the raw system calls (no liburing): the submission
// and completion rings are mmap'd from the ring descriptor, completions are
// signalled on an eventfd registered with the ring.
#include <linux/io_uring.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>

#include "common/error.hpp"
#include "common/mapped_region.hpp"
#include "common/unique_fd.hpp"
#include "io/backend.hpp"
#include "io/limits.hpp"

namespace infinity::io {
namespace {

int sys_io_uring_setup(unsigned entries, io_uring_params* p) {
    return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}
int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return static_cast<int>(
        ::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_io_uring_register(int fd, unsigned opcode, const void* arg, unsigned nr_args) {
    return static_cast<int>(::syscall(__NR_io_uring_register, fd, opcode, arg, nr_args));
}

// NOTE: the ring indices are shared with the kernel. Loads of indices the
// kernel writes need acquire; stores of indices the kernel reads need release,
// so the SQE/CQE contents are ordered with respect to them.
unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

MappedRegion map_ring(int fd, std::size_t size, off_t what, const char* label) {
    void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
    if (addr == MAP_FAILED) throw_errno(std::string("mmap of io_uring ") + label);
    return MappedRegion(addr, size);
}

class UringBackend final : public Backend {
  public:
    explicit UringBackend(std::uint32_t depth) {
        io_uring_params p;
        std::memset(&p, 0, sizeof p);
        int fd = sys_io_uring_setup(depth, &p);
        if (fd < 0) throw_errno("io_uring_setup(" + std::to_string(depth) + " entries)");
        ring_fd_.reset(fd);
        if (p.sq_entries < depth) {
            throw SystemError("io_uring_setup gave " + std::to_string(p.sq_entries) +
                                  " entries for a queue depth of " + std::to_string(depth),
                              EINVAL);
        }

        std::size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        std::size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
        if (single) sq_size = cq_size = std::max(sq_size, cq_size);
        sq_map_ = map_ring(fd, sq_size, IORING_OFF_SQ_RING, "submission ring");
        if (!single) cq_map_ = map_ring(fd, cq_size, IORING_OFF_CQ_RING, "completion ring");
        const MappedRegion& cq = single ? sq_map_ : cq_map_;
        sqe_map_ = map_ring(fd, p.sq_entries * sizeof(io_uring_sqe), IORING_OFF_SQES, "SQE array");

        sq_head_ = sq_map_.at<unsigned>(p.sq_off.head);
        sq_tail_ = sq_map_.at<unsigned>(p.sq_off.tail);
        sq_mask_ = *sq_map_.at<unsigned>(p.sq_off.ring_mask);
        sq_array_ = sq_map_.at<unsigned>(p.sq_off.array);
        cq_head_ = cq.at<unsigned>(p.cq_off.head);
        cq_tail_ = cq.at<unsigned>(p.cq_off.tail);
        cq_mask_ = *cq.at<unsigned>(p.cq_off.ring_mask);
        cqes_ = cq.at<io_uring_cqe>(p.cq_off.cqes);
        sqes_ = sqe_map_.at<io_uring_sqe>(0);
        tail_ = *sq_tail_;

        int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (efd < 0) throw_errno("eventfd for io_uring completions");
        event_fd_.reset(efd);
        if (sys_io_uring_register(fd, IORING_REGISTER_EVENTFD, &efd, 1) < 0) {
            throw_errno("io_uring_register(IORING_REGISTER_EVENTFD)");
        }
    }

    const char* name() const noexcept override { return "io_uring"; }

    void prepare(std::uint32_t slot, Op op, int fd, char* buf, std::uint32_t len,
                 std::uint64_t offset) override {
        unsigned index = tail_ & sq_mask_;
        io_uring_sqe* sqe = &sqes_[index];
        std::memset(sqe, 0, sizeof *sqe);
        sqe->opcode = op == Op::Read ? IORING_OP_READ : IORING_OP_WRITE;
        if (auto table = std::atomic_load(&regions_)) {
            const int found = find_region(*table, buf, len);
            if (found >= 0) {
                sqe->opcode = op == Op::Read ? IORING_OP_READ_FIXED : IORING_OP_WRITE_FIXED;
                sqe->buf_index = static_cast<std::uint16_t>(found);
                fixed_.fetch_add(1, std::memory_order_relaxed);
            }
        }
        sqe->fd = fd;
        sqe->addr = reinterpret_cast<std::uint64_t>(buf);
        sqe->len = len;
        sqe->off = offset;
        sqe->user_data = slot;
        sq_array_[index] = index;
        ++tail_;
        // The kernel reads the tail only inside io_uring_enter, so publishing
        // here (rather than in submit) is safe and keeps submit simple.
        store_release(sq_tail_, tail_);
    }

    std::size_t staged() const noexcept override { return tail_ - load_acquire(sq_head_); }

    std::size_t submit(std::vector<Completion>& refused) override {
        for (;;) {
            unsigned pending = static_cast<unsigned>(staged());
            if (pending == 0) return 0;
            const int injected = take_injected_submit_errno();
            int r = injected ? (errno = injected, -1) : sys_io_uring_enter(ring_fd_.get(), pending, 0, 0);
            if (r >= 0) {  // the rest stays in the ring for the next call
                in_kernel_ += static_cast<unsigned>(r);
                return static_cast<std::size_t>(r);
            }
            int err = errno;
            if (err == EINTR) continue;
            // Out of kernel resources or completion backlog: retry after reaping.
            if (err == EAGAIN || err == EBUSY) return 0;
            // Anything else means the ring itself is unusable: fail what is
            // staged with that errno.
            cancel_staged(refused, err);
            return 0;
        }
    }

    void cancel_staged(std::vector<Completion>& out, int err) override {
        // NOTE: without SQPOLL the kernel reads the submission ring only inside
        // io_uring_enter, so entries it has not consumed can be taken back.
        unsigned head = load_acquire(sq_head_);
        for (unsigned i = head; i != tail_; ++i) {
            const io_uring_sqe& sqe = sqes_[sq_array_[i & sq_mask_]];
            out.push_back({static_cast<std::uint32_t>(sqe.user_data), -err});
        }
        tail_ = head;
        store_release(sq_tail_, tail_);
    }

    int completion_fd() const noexcept override { return event_fd_.get(); }

    std::uint64_t fixed_transfers() const noexcept override {
        return fixed_.load(std::memory_order_relaxed);
    }

    int register_regions(const std::vector<Region>& regions) override {
        if (regions.empty()) return 0;
        if (regions.size() > kMaxRegions) return E2BIG;
        std::vector<iovec> iov;
        iov.reserve(regions.size());
        for (const Region& r : regions) {
            if (r.base == nullptr || r.len == 0 || r.len > kMaxRegisteredBytes) return EINVAL;
            iov.push_back({r.base, r.len});
        }
        std::lock_guard<std::mutex> lock(register_mu_);
        if (std::atomic_load(&regions_)) return EBUSY;
        if (sys_io_uring_register(ring_fd_.get(), IORING_REGISTER_BUFFERS, iov.data(),
                                  static_cast<unsigned>(iov.size())) < 0) {
            return errno;
        }
        // Published only once the kernel has them: the worker never names a
        // buffer index the ring does not know.
        std::atomic_store(&regions_, std::make_shared<const std::vector<Region>>(regions));
        return 0;
    }

    std::size_t reap(std::vector<Completion>& out) override {
        unsigned head = *cq_head_;  // only this thread writes the head
        unsigned tail = load_acquire(cq_tail_);
        std::size_t n = 0;
        for (; head != tail; ++head, ++n) {
            const io_uring_cqe& cqe = cqes_[head & cq_mask_];
            out.push_back({static_cast<std::uint32_t>(cqe.user_data), cqe.res});
        }
        store_release(cq_head_, head);
        in_kernel_ -= static_cast<unsigned>(std::min<std::size_t>(n, in_kernel_));
        return n;
    }

    ~UringBackend() override {
        // Closing a ring cancels its requests asynchronously, which could let
        // the kernel touch buffers after we return: wait for them instead.
        // NOTE: an error of the waiting call (EBUSY with a full completion
        // ring, ENOMEM, ...) is no reason to stop: closing now would free
        // memory under the kernel. Reap what is there and wait again, sleeping
        // briefly on the completion eventfd when the call itself keeps failing.
        while (in_kernel_ > 0) {
            int r = sys_io_uring_enter(ring_fd_.get(), 0, in_kernel_, IORING_ENTER_GETEVENTS);
            const bool failed = r < 0 && errno != EINTR;
            unsigned head = *cq_head_;
            unsigned tail = load_acquire(cq_tail_);
            in_kernel_ -= std::min(in_kernel_, tail - head);
            store_release(cq_head_, tail);
            if (failed && tail == head && in_kernel_ > 0) {
                pollfd fd{event_fd_.get(), POLLIN, 0};
                ::poll(&fd, 1, 10);
            }
        }
    }

  private:
    // The kernel's limits: at most UIO_MAXIOV buffers of at most 1 GiB each.
    static constexpr std::size_t kMaxRegions = 1024;

    // Index of the registered region holding [buf, buf + len), or -1.
    static int find_region(const std::vector<Region>& table, const char* buf, std::size_t len) {
        for (std::size_t i = 0; i < table.size(); ++i) {
            const Region& r = table[i];
            if (buf >= r.base && len <= r.len &&
                static_cast<std::size_t>(buf - r.base) <= r.len - len) {
                return static_cast<int>(i);
            }
        }
        return -1;
    }

    std::mutex register_mu_;
    std::atomic<std::uint64_t> fixed_{0};
    std::shared_ptr<const std::vector<Region>> regions_;  // atomic_load/atomic_store only

    // Declaration order matters for destruction: the mappings go before the
    // ring descriptor they came from (members are destroyed in reverse).
    UniqueFd ring_fd_;
    UniqueFd event_fd_;
    MappedRegion sq_map_, cq_map_, sqe_map_;
    unsigned* sq_head_ = nullptr;
    unsigned* sq_tail_ = nullptr;
    unsigned sq_mask_ = 0;
    unsigned* sq_array_ = nullptr;
    unsigned* cq_head_ = nullptr;
    unsigned* cq_tail_ = nullptr;
    unsigned cq_mask_ = 0;
    io_uring_cqe* cqes_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    unsigned tail_ = 0;       // our copy of the submission tail
    unsigned in_kernel_ = 0;  // submitted and not yet reaped
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(std::uint32_t depth) {
    return std::make_unique<UringBackend>(depth);
}

}  // namespace infinity::io
