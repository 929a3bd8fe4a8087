// Python bindings of the CPU-Lion kernel (`infinity._C.lion`). Buffers come in
// as integer addresses: infinity/optim/lion_kernel.py validates every tensor
// (device, dtype, contiguity, size, overlap) before calling in here. Dtype and
// state-format codes are every kernel's (simd/formats.hpp, exported as
// `_C.adam.dtype_codes`, `_C.adam.state_formats`). See NOTE [raw pointers into native code].
#include <pybind11/pybind11.h>

#include <cstdint>

#include "lion/lion_kernels.hpp"
#include "lion/lion_step.hpp"
#include "simd/bind_args.hpp"

namespace py = pybind11;

namespace infinity {
namespace {

using bind::as_ptr;
using bind::to_count;
using bind::to_state;

void step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t out16,
          int out_dtype, int64_t n, double lr, double beta1, double beta2, double weight_decay,
          double grad_scale, int state_format, uintptr_t exp_avg_scale, int64_t step_count,
          uint64_t round_stream, int64_t round_offset) {
    auto b = bind::flat_buffers<lion::LionBuffers>(param, grad, grad_dtype, out16, out_dtype, n);
    b.exp_avg = as_ptr<void>(exp_avg);
    b.exp_avg_scale = as_ptr<float>(exp_avg_scale);
    b.state = to_state(state_format);
    b.round_stream = round_stream;
    b.round_offset = round_offset;
    lion::LionHyper h;
    h.step = step_count;
    h.lr = lr;
    h.beta1 = beta1;
    h.beta2 = beta2;
    h.weight_decay = weight_decay;
    h.grad_scale = grad_scale;
    lion::lion_step(b, h);
}

}  // namespace

void bind_lion(py::module_& m) {
    m.def("step", &step, py::call_guard<py::gil_scoped_release>(), py::arg("param"),
          py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("out16"),
          py::arg("out_dtype"), py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"), py::arg("grad_scale"), py::arg("state_format") = 0,
          py::arg("exp_avg_scale") = 0, py::arg("step") = 1, py::arg("round_stream") = 0,
          py::arg("round_offset") = 0,
          "Fused Lion step over raw, validated buffers (codes as _C.adam's; out16=0 for none; "
          "int8 momentum with its block-scale buffer; step, round_stream and round_offset draw "
          "the random bits of a bf16 momentum's stochastic rounding). Releases the GIL.");
    m.def(
        "q8_encode_signed",
        [](uintptr_t values, uintptr_t code, uintptr_t scale, int64_t n) {
            lion::q8_encode_signed(as_ptr<const float>(values), as_ptr<uint8_t>(code),
                                   as_ptr<float>(scale), to_count(n, "q8_encode_signed"));
        },
        py::call_guard<py::gil_scoped_release>(), py::arg("values"), py::arg("code"),
        py::arg("scale"), py::arg("n"),
        "Encode n fp32 values into the signed int8 codes and block scales of the momentum.");
}

}  // namespace infinity
