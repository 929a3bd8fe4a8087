// Waiting on native work from Python without holding the GIL, yet
// interruptible by Ctrl-C. See NOTE [GIL and native threads] (docs/NOTES.md).
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace infinity {

/// Waits in slices with the GIL released, checking for Python signals in
/// between. Returns true when `done` holds, false on timeout (None = none).
template <typename Done, typename WaitSlice>
bool wait_interruptibly(Done done, WaitSlice wait_slice, std::optional<double> timeout) {
    using namespace std::chrono;
    const auto slice = milliseconds(50);
    const auto start = steady_clock::now();
    for (;;) {
        if (done()) return true;
        auto step = duration_cast<nanoseconds>(slice);
        if (timeout) {
            auto left = duration_cast<nanoseconds>(duration<double>(*timeout)) -
                        (steady_clock::now() - start);
            if (left <= nanoseconds::zero()) return done();
            step = std::min(step, left);
        }
        {
            pybind11::gil_scoped_release release;
            wait_slice(step);
        }
        if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
    }
}

}  // namespace infinity
