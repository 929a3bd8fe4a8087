// Placeholder: the I/O layer registers its bindings here.
#include <pybind11/pybind11.h>

namespace infinity {
void bind_io(pybind11::module_& /*m*/) {}
}  // namespace infinity
