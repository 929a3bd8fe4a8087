// The native module `infinity._C`: one pybind11 module, one registration
// function per concern, each defined next to the code it exposes.
#include <pybind11/pybind11.h>

namespace infinity {
void bind_io(pybind11::module_& m);    // cpp/io/bind_io.cpp
void bind_adam(pybind11::module_& m);  // cpp/adam/bind_adam.cpp
void bind_devices(pybind11::module_& m);  // cpp/devices/bind_devices.cpp
}  // namespace infinity

PYBIND11_MODULE(_C, m) {
    m.doc() = "infinity native core: async NVMe I/O, vectorized CPU Adam, host copy queue";
    auto io = m.def_submodule("io", "asynchronous O_DIRECT file I/O");
    auto adam = m.def_submodule("adam", "fused CPU Adam/AdamW kernels");
    infinity::bind_io(io);
    infinity::bind_adam(adam);
    auto devices = m.def_submodule("devices", "the CPU backend's native copy queue");
    infinity::bind_devices(devices);
}
