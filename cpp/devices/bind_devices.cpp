// Python bindings of the CPU backend's copy queue (submodule infinity._C.devices).
// infinity.devices.cpu validates tensors before passing their addresses here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>

#include "common/py_wait.hpp"
#include "devices/copy_queue.hpp"

namespace py = pybind11;

namespace infinity {

void bind_devices(py::module_& m) {
    using devices::CopyJob;
    using devices::CopyJobPtr;
    using devices::CopyQueue;

    py::class_<CopyJob, CopyJobPtr>(m, "CopyJob", "Completion handle of one queued copy.")
        .def("done", &CopyJob::done)
        .def(
            "wait",
            [](const CopyJobPtr& job, std::optional<double> timeout) {
                return wait_interruptibly(
                    [&] { return job->done(); },
                    [&](std::chrono::nanoseconds step) { job->wait_for(step); }, timeout);
            },
            py::arg("timeout") = py::none(),
            "Wait (GIL released) until the copy is done; False on timeout.");

    py::class_<CopyQueue>(m, "CopyQueue", "In-order memory copies on one native thread.")
        .def(py::init<>())
        .def(
            "submit",
            [](CopyQueue& q, std::uintptr_t dst, std::uintptr_t src, std::uint64_t nbytes,
               std::uint64_t delay_us) {
                return q.submit(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src),
                                nbytes, std::chrono::microseconds(delay_us));
            },
            py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("delay_us") = 0,
            "Queue memmove(dst, src, nbytes) after delay_us; returns its CopyJob.")
        .def("close", &CopyQueue::close, py::call_guard<py::gil_scoped_release>(),
             "Finish every queued copy, then stop the thread.");
}

}  // namespace infinity
