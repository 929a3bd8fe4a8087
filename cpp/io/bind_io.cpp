// Python bindings of the I/O layer (submodule infinity._C.io). The Python
// package infinity.io validates every argument before calling these; the
// checks here only keep the native API safe on its own.
// See NOTE [raw pointers into native code] (docs/NOTES.md).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>

#include "common/error.hpp"
#include "common/py_wait.hpp"
#include "io/engine.hpp"
#include "io/file_ops.hpp"
#include "io/limits.hpp"
#include "io/probe.hpp"

namespace py = pybind11;

namespace infinity {
namespace {

using io::Request;
using io::RequestPtr;

bool wait_one(const RequestPtr& r, std::optional<double> timeout) {
    return wait_interruptibly([&] { return r->done(); },
                              [&](std::chrono::nanoseconds step) { r->wait_for(step); }, timeout);
}

bool wait_many(const std::vector<RequestPtr>& reqs, std::optional<double> timeout) {
    std::size_t next = 0;  // requests before `next` are done
    auto all_done = [&] {
        while (next < reqs.size() && reqs[next]->done()) ++next;
        return next == reqs.size();
    };
    return wait_interruptibly(all_done,
                              [&](std::chrono::nanoseconds step) {
                                  if (next < reqs.size()) reqs[next]->wait_for(step);
                              },
                              timeout);
}

}  // namespace

void bind_io(py::module_& m) {
    // SystemError surfaces as OSError with .errno set: see translate_error() in cpp/module.cpp.
    // The I/O contract (io/limits.hpp), read by infinity/_native/io.py.
    m.attr("ALIGNMENT") = io::kAlignment;
    m.attr("MAX_BLOCK_SIZE") = io::kMaxBlockSize;
    m.attr("MAX_QUEUE_DEPTH") = io::kMaxQueueDepth;
    m.attr("MAX_THREADS") = io::kMaxThreads;
    m.attr("MAX_REGISTERED_BYTES") = io::kMaxRegisteredBytes;

    m.def("available_backends", &io::available_backends,
          "Backends that completed a real write and read-back here, best first.");
    m.def("probe_results", &io::probe_results,
          "Backend name -> '' if it works here, else the reason it does not.");
    m.def(
        "preallocate",
        [](int fd, std::uint64_t nbytes, const std::string& path) {
            py::gil_scoped_release release;
            io::preallocate(fd, nbytes, path);
        },
        py::arg("fd"), py::arg("nbytes"), py::arg("path"),
        "Reserve nbytes from offset 0 (fallocate, posix_fallocate fallback); OSError on failure.");

    py::class_<Request, RequestPtr>(m, "Request", "Completion handle of one transfer.")
        .def("done", &Request::done)
        .def_property_readonly("bytes_done", &Request::bytes_done)
        .def_property_readonly("nbytes", [](const Request& r) { return r.nbytes; })
        .def("wait", &wait_one, py::arg("timeout") = py::none(),
             "Wait (GIL released) until done; False on timeout. Errors are read with error().")
        .def(
            "error",
            [](const Request& r) -> py::object {
                if (!r.done() || r.error_code() == 0) return py::none();
                return py::make_tuple(r.error_code(), r.error_message());
            },
            "None, or (errno, message) once a failed request is done.");

    m.def("wait_all", &wait_many, py::arg("requests"), py::arg("timeout") = py::none(),
          "Wait (GIL released) until every request is done; False on timeout.");

    py::class_<io::Engine>(m, "Engine", "Asynchronous O_DIRECT I/O engine (see infinity.io.IOEngine).")
        .def(py::init([](const std::string& backend, std::uint64_t block_size,
                         std::uint32_t queue_depth, std::uint32_t threads) {
                 return std::make_unique<io::Engine>(
                     io::EngineConfig{backend, block_size, queue_depth, threads});
             }),
             py::arg("backend"), py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"))
        .def(
            "submit",
            [](io::Engine& e, bool write, std::uintptr_t ptr, std::uint64_t nbytes, int fd,
               std::uint64_t offset, std::string path) {
                return e.submit(write ? io::Op::Write : io::Op::Read, reinterpret_cast<char*>(ptr),
                                nbytes, fd, offset, std::move(path));
            },
            py::arg("write"), py::arg("ptr"), py::arg("nbytes"), py::arg("fd"), py::arg("offset"),
            py::arg("path"))
        .def(
            "register_buffers",
            [](io::Engine& e, const std::vector<std::pair<std::uintptr_t, std::size_t>>& spans) {
                std::vector<io::Region> regions;
                regions.reserve(spans.size());
                for (const auto& [ptr, len] : spans) {
                    regions.push_back({reinterpret_cast<char*>(ptr), len});
                }
                py::gil_scoped_release release;
                return e.register_buffers(regions);
            },
            py::arg("spans"),
            "Register (address, length) spans as fixed buffers; 0 or the errno why not.")
        .def_property_readonly("fixed_transfers", &io::Engine::fixed_transfers)
        .def_property_readonly(
            "busy_seconds", [](io::Engine& e) { return e.busy_seconds(); },
            "Seconds so far with at least one piece of a request in flight (any worker).")
        .def("close", &io::Engine::close, py::call_guard<py::gil_scoped_release>(),
             "Finish every queued and in-flight request, then stop the workers.")
        .def_property_readonly("closed", &io::Engine::closed)
        .def_property_readonly("backend", [](const io::Engine& e) { return e.config().backend; })
        .def("inject_fault", &io::Engine::inject_fault, py::arg("nth"), py::arg("errno"),
             py::arg("per_request"))
        .def(
            "inject_delay",
            [](io::Engine& e, std::uint64_t us) { e.inject_delay(std::chrono::microseconds(us)); },
            py::arg("us"))
        .def("inject_short_transfer", &io::Engine::inject_short_transfer, py::arg("nth"))
        .def("inject_submit_error", &io::Engine::inject_submit_error, py::arg("nth"),
             py::arg("errno"))
        .def("inject_worker_failure", &io::Engine::inject_worker_failure, py::arg("count"));
}

}  // namespace infinity
