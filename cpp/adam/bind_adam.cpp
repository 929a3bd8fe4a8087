// Placeholder: the CPU-Adam kernels register their bindings here.
#include <pybind11/pybind11.h>

namespace infinity {
void bind_adam(pybind11::module_& /*m*/) {}
}  // namespace infinity
