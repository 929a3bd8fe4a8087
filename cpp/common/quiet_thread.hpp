// Starting library threads that never receive process signals.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace infinity {

/// Starts a std::thread named `name` (<= 15 characters: what top, py-spy
/// and /proc/<pid>/task/*/comm show) with every signal blocked.
///
/// See NOTE [GIL and native threads] (docs/NOTES.md). The mask is set in the
/// *creating* thread around the spawn so the new thread inherits it from its
/// first instruction, with no window in which a signal could land there.
template <typename F>
std::thread start_quiet_thread(const char* name, F&& body) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    struct Restore {
        sigset_t* old;
        ~Restore() { pthread_sigmask(SIG_SETMASK, old, nullptr); }
    } restore{&old};
    std::thread thread(std::forward<F>(body));
    // NOTE: named by the creator, so the name is there when this returns.
    // Failure (a name over 15 characters) only leaves the thread unnamed.
    pthread_setname_np(thread.native_handle(), name);
    return thread;
}

}  // namespace infinity
