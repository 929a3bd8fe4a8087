// Python bindings of the CPU-SGD kernel (`infinity._C.sgd`). Buffers come in
// as integer addresses: infinity/optim/sgd_kernel.py validates every tensor
// (device, dtype, contiguity, size, overlap) before calling in here. Dtype and
// state-format codes are every kernel's (simd/formats.hpp, exported as
// `_C.adam.dtype_codes`, `_C.adam.state_formats`). See NOTE [raw pointers into native code].
#include <pybind11/pybind11.h>

#include <cstdint>

#include "sgd/sgd_kernels.hpp"
#include "simd/bind_args.hpp"

namespace py = pybind11;

namespace infinity {
namespace {

using bind::as_ptr;
using bind::to_state;

void step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t momentum_buffer,
          int state_format, uintptr_t out16, int out_dtype, int64_t n, double lr, double momentum,
          double dampening, double weight_decay, bool nesterov, bool maximize, bool first_step,
          double grad_scale) {
    auto b = bind::flat_buffers<sgd::SgdBuffers>(param, grad, grad_dtype, out16, out_dtype, n);
    b.momentum_buffer = as_ptr<void>(momentum_buffer);
    b.state = to_state(state_format);
    sgd::SgdHyper h;
    h.lr = lr;
    h.momentum = momentum;
    h.dampening = dampening;
    h.weight_decay = weight_decay;
    h.nesterov = nesterov;
    h.maximize = maximize;
    h.first_step = first_step;
    h.grad_scale = grad_scale;
    sgd::sgd_step(b, h);
}

}  // namespace

void bind_sgd(py::module_& m) {
    m.def("step", &step, py::call_guard<py::gil_scoped_release>(), py::arg("param"),
          py::arg("grad"), py::arg("grad_dtype"), py::arg("momentum_buffer"),
          py::arg("state_format"), py::arg("out16"), py::arg("out_dtype"), py::arg("n"),
          py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
          py::arg("nesterov"), py::arg("maximize"), py::arg("first_step"), py::arg("grad_scale"),
          "Fused SGD step over raw, validated buffers (codes as _C.adam's; momentum_buffer=0 "
          "when momentum is 0, out16=0 for none). Releases the GIL.");
}

}  // namespace infinity
