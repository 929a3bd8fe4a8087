// Starting library threads that never receive process signals.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace infinity {

/// Starts a std::thread with every signal blocked.
///
/// NOTE: Python handles signals (Ctrl-C, alarms) in its main thread, and a
/// blocking system call in one of our threads that caught a signal would only
/// see a spurious EINTR. The mask is set in the *creating* thread around the
/// spawn so the new thread inherits it from its first instruction, with no
/// window in which a signal could land there.
template <typename F>
std::thread start_quiet_thread(F&& body) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    struct Restore {
        sigset_t* old;
        ~Restore() { pthread_sigmask(SIG_SETMASK, old, nullptr); }
    } restore{&old};
    return std::thread(std::forward<F>(body));
}

}  // namespace infinity
