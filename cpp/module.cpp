// The native module `infinity._C`: one pybind11 module, one registration
// function per concern, each defined next to the code it exposes.
#include <pybind11/pybind11.h>

#include <exception>
#include <stdexcept>

#include "common/error.hpp"

namespace py = pybind11;

namespace infinity {
void bind_io(pybind11::module_& m);    // cpp/io/bind_io.cpp
void bind_adam(pybind11::module_& m);  // cpp/adam/bind_adam.cpp
void bind_lion(pybind11::module_& m);  // cpp/lion/bind_lion.cpp
void bind_sgd(pybind11::module_& m);   // cpp/sgd/bind_sgd.cpp
void bind_devices(pybind11::module_& m);  // cpp/devices/bind_devices.cpp

namespace {

// The exceptions of cpp/common/error.hpp reach Python as the types pybind11
// gives their standard bases (std::invalid_argument -> ValueError, other
// std::runtime_error -> RuntimeError), except SystemError (errno + context),
// which surfaces as OSError with .errno set so Python maps it to the usual
// subclasses (PermissionError, ...). The line that threw becomes an exception
// note, printed under the message from Python 3.11 on (see
// NOTE [errors name their source line]). Other exceptions go on to pybind11.
void translate_error(std::exception_ptr p) {
    try {
        if (p) std::rethrow_exception(p);
    } catch (const std::exception& e) {
        const auto* at = dynamic_cast<const ThrownAt*>(&e);
        if (at == nullptr) throw;
        try {
            py::object exc;
            if (const auto* sys = dynamic_cast<const SystemError*>(&e)) {
                exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(sys->code(), e.what());
            } else if (dynamic_cast<const std::invalid_argument*>(&e) != nullptr) {
                exc = py::reinterpret_borrow<py::object>(PyExc_ValueError)(e.what());
            } else {
                exc = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
            }
            if (py::hasattr(exc, "add_note")) {  // Python >= 3.11 (PEP 678)
                exc.attr("add_note")("raised at " + std::string(at->where().file) + ":" +
                                     std::to_string(at->where().line));
            }
            PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
        } catch (py::error_already_set& failed) {
            failed.restore();  // building the exception failed (MemoryError): raise that
        }
    }
}

}  // namespace
}  // namespace infinity

PYBIND11_MODULE(_C, m) {
    py::register_exception_translator(&infinity::translate_error);
    m.doc() = "infinity native core: async NVMe I/O, vectorized CPU Adam, Lion and SGD, host copy queue";
    auto io = m.def_submodule("io", "asynchronous O_DIRECT file I/O");
    auto adam = m.def_submodule("adam", "fused CPU Adam/AdamW kernels");
    infinity::bind_io(io);
    infinity::bind_adam(adam);
    auto lion = m.def_submodule("lion", "fused CPU Lion kernel");
    infinity::bind_lion(lion);
    auto sgd = m.def_submodule("sgd", "fused CPU SGD kernel");
    infinity::bind_sgd(sgd);
    auto devices = m.def_submodule("devices", "the CPU backend's native copy queue");
    infinity::bind_devices(devices);
}
