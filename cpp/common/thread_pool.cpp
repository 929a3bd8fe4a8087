#include "common/thread_pool.hpp"

#include "common/unique_fd.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#if defined(__linux__)
#include <sched.h>
#endif

namespace infinity {

ThreadPool::ThreadPool(int num_threads) {
    const int workers = std::max(num_threads, 1) - 1;
    workers_.reserve(workers);
    for (int i = 0; i < workers; ++i) {
        workers_.emplace_back([this] { worker_loop(); });
        pthread_setname_np(workers_.back().native_handle(), "inf-compute");
    }
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
}

void ThreadPool::drain() {
    for (;;) {
        int64_t i;
        {
            // NOTE: a mutex, not an atomic: tasks are coarse (>= tens of
            // microseconds), and a lock keeps the claim and the bounds check
            // trivially consistent.
            std::lock_guard<std::mutex> lock(mutex_);
            if (next_ >= num_tasks_) return;
            i = next_++;
        }
        try {
            (*task_)(i);
        } catch (...) {
            std::lock_guard<std::mutex> lock(mutex_);
            if (!error_) error_ = std::current_exception();
        }
    }
}

void ThreadPool::worker_loop() {
    uint64_t seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
        }
        drain();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (--busy_ == 0) done_.notify_one();
        }
    }
}

void ThreadPool::run(int64_t num_tasks, const std::function<void(int64_t)>& task) {
    if (num_tasks <= 0) return;
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    if (workers_.empty() || num_tasks == 1) {
        for (int64_t i = 0; i < num_tasks; ++i) task(i);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        task_ = &task;
        num_tasks_ = num_tasks;
        next_ = 0;
        busy_ = static_cast<int>(workers_.size());
        error_ = nullptr;
        ++generation_;
    }
    wake_.notify_all();
    drain();
    std::exception_ptr error;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return busy_ == 0; });
        task_ = nullptr;
        error = std::exchange(error_, nullptr);
    }
    if (error) std::rethrow_exception(error);
}

namespace {

// A small non-negative integer from a sysfs file, or -1.
// NOTE: plain read(2) and strtol, no iostreams: an ifstream's locale facets
// crashed (SIGSEGV in codecvt) in a process whose libstdc++ was older than the
// one this module was compiled against (torch 2.11's CUDA image, GCC 13).
int read_int(const std::string& path) {
    const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return -1;
    char text[32] = {};
    const ssize_t got = ::read(fd.get(), text, sizeof text - 1);
    if (got <= 0) return -1;
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(text, &end, 10);
    if (end == text || errno != 0 || value < 0 || value > 1'000'000) return -1;
    return static_cast<int>(value);
}

}  // namespace

namespace {

int detect_num_threads() {
    int logical = static_cast<int>(std::thread::hardware_concurrency());
    int physical = logical;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        logical = CPU_COUNT(&set);
        std::set<std::pair<int, int>> cores;  // (package, core) pairs
        bool topology_known = true;
        for (int cpu = 0; cpu < CPU_SETSIZE && topology_known; ++cpu) {
            if (!CPU_ISSET(cpu, &set)) continue;
            const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
            const int package = read_int(dir + "physical_package_id");
            const int core = read_int(dir + "core_id");
            if (package < 0 || core < 0) topology_known = false;
            cores.emplace(package, core);
        }
        physical = topology_known ? static_cast<int>(cores.size()) : logical;
    }
#endif
    return std::clamp(std::min(physical, logical), 1, 64);
}

}  // namespace

int default_num_threads() {
    // NOTE: detected once: it reads sysfs for every allowed CPU (~20 us), and
    // the default must stay cheap because every step asks for it.
    static const int detected = detect_num_threads();
    return detected;
}

namespace {

struct PoolRegistry {
    std::mutex mutex;
    std::shared_ptr<ThreadPool> pool;
    pid_t owner = 0;  // process that created `pool`
    int requested = 0;  // 0: default_num_threads()
};

PoolRegistry& registry() {
    // NOTE: deliberately leaked. Joining worker threads from a static
    // destructor during interpreter shutdown can hang; the OS reclaims them.
    static PoolRegistry* r = new PoolRegistry();
    return *r;
}

}  // namespace

std::shared_ptr<ThreadPool> compute_pool() {
    PoolRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const pid_t pid = getpid();
    if (r.pool && r.owner != pid) {
        // Leak it and start over: see NOTE [fork and native threads] (docs/NOTES.md).
        new std::shared_ptr<ThreadPool>(std::move(r.pool));
        r.pool.reset();
    }
    if (!r.pool) {
        r.pool = std::make_shared<ThreadPool>(r.requested > 0 ? r.requested : default_num_threads());
        r.owner = pid;
    }
    return r.pool;
}

void set_compute_threads(int num_threads) {
    PoolRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const int wanted = num_threads > 0 ? num_threads : default_num_threads();
    r.requested = num_threads > 0 ? num_threads : 0;
    if (r.pool && r.owner == getpid() && r.pool->num_threads() == wanted) return;
    if (r.pool && r.owner != getpid()) new std::shared_ptr<ThreadPool>(std::move(r.pool));
    r.pool.reset();  // a running loop holds its own reference
}

int compute_threads() {
    PoolRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.pool && r.owner == getpid()) return r.pool->num_threads();
    return r.requested > 0 ? r.requested : default_num_threads();
}

}  // namespace infinity
