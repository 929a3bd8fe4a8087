// A small fixed-size thread pool for data-parallel loops over index ranges.
//
// NOTE: we do not use OpenMP: torch already loads its own OpenMP runtime and
// a second one in the same process fights it for cores.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity {

/// A pool of `num_threads - 1` worker threads plus the calling thread.
///
/// `run(n, task)` calls `task(i)` once for every i in [0, n), spread over the
/// workers and the caller, and returns when all calls have finished. Tasks
/// are claimed dynamically (an atomic counter), so a core busy with another
/// process slows the loop down by its share only. Calls to `run` from several
/// threads are serialised. The first exception a task throws is rethrown by
/// `run` after every task has finished.
class ThreadPool {
  public:
    /// @param num_threads total threads, caller included (>= 1).
    explicit ThreadPool(int num_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    /// Total threads that execute tasks, the caller included.
    int num_threads() const noexcept { return static_cast<int>(workers_.size()) + 1; }

    /// Runs task(0) ... task(num_tasks - 1); blocks until all have returned.
    void run(int64_t num_tasks, const std::function<void(int64_t)>& task);

  private:
    void worker_loop();
    void drain();  // claims and runs tasks of the current generation

    std::vector<std::thread> workers_;
    std::mutex run_mutex_;  // one run() at a time
    std::mutex mutex_;      // guards everything below
    std::condition_variable wake_;
    std::condition_variable done_;
    uint64_t generation_ = 0;
    bool stop_ = false;
    int busy_ = 0;  // workers that have not finished the current generation
    const std::function<void(int64_t)>* task_ = nullptr;
    int64_t num_tasks_ = 0;
    int64_t next_ = 0;
    std::exception_ptr error_;
};

/// Threads a compute pool should use by default: the distinct physical cores
/// among the CPUs this process may run on (sched_getaffinity), so hyper-thread
/// siblings do not compete for one core's load/store units; capped at 64.
/// Detected once per process.
int default_num_threads();

/// The process-wide compute pool, created on first use with
/// `default_num_threads()` threads (or the count last set). After a fork the
/// child gets a fresh pool (the parent's worker threads do not exist there).
std::shared_ptr<ThreadPool> compute_pool();

/// Sets the size of the compute pool (>= 1; 0 = default_num_threads()). A
/// loop already running keeps its old pool until it returns.
void set_compute_threads(int num_threads);

/// Threads of the compute pool (the configured count; the pool itself is lazy).
int compute_threads();

}  // namespace infinity
