// Python bindings of the CPU-Adam kernels (`infinity._C.adam`). Buffers come
// in as integer addresses: infinity/optim/kernels.py validates every tensor
// (device, dtype, contiguity, size, overlap) before calling in here.
// See NOTE [raw pointers into native code] (docs/NOTES.md).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "adam/adam_step.hpp"
#include "adam/kernels.hpp"
#include "common/error.hpp"
#include "common/thread_pool.hpp"
#include "simd/bandwidth.hpp"
#include "simd/bind_args.hpp"
#include "simd/isa.hpp"

namespace py = pybind11;

namespace infinity {
namespace {

using bind::as_ptr;
using bind::to_count;
using bind::to_state;

py::dict dtype_codes(bool out16_only) {
    py::dict codes;
    for (const simd::DTypeInfo& t : simd::kDTypes) {
        if (t.out16 || !out16_only) codes[t.name] = static_cast<int>(t.code);
    }
    return codes;
}

adam::AdamBuffers make_buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                               uintptr_t exp_avg_sq, uintptr_t out16, int out_dtype, int64_t n) {
    auto b = bind::flat_buffers<adam::AdamBuffers>(param, grad, grad_dtype, out16, out_dtype, n);
    b.exp_avg = as_ptr<void>(exp_avg);
    b.exp_avg_sq = as_ptr<void>(exp_avg_sq);
    return b;
}

adam::AdamHyper make_hyper(int64_t step_count, double lr, double beta1, double beta2, double eps,
                           double weight_decay, bool adamw, double grad_scale) {
    adam::AdamHyper h;
    h.step = step_count;
    h.lr = lr;
    h.beta1 = beta1;
    h.beta2 = beta2;
    h.eps = eps;
    h.weight_decay = weight_decay;
    h.adamw = adamw;
    h.grad_scale = grad_scale;
    return h;
}

void step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
          uintptr_t out16, int out_dtype, int64_t n, int64_t step_count, double lr, double beta1,
          double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
          int state_format, uintptr_t exp_avg_scale, uintptr_t exp_avg_sq_scale,
          uint64_t round_stream, int64_t round_offset) {
    adam::AdamBuffers b =
        make_buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, out16, out_dtype, n);
    b.state = to_state(state_format);
    b.exp_avg_scale = as_ptr<float>(exp_avg_scale);
    b.exp_avg_sq_scale = as_ptr<float>(exp_avg_sq_scale);
    b.round_stream = round_stream;
    b.round_offset = round_offset;
    adam::adam_step(b, make_hyper(step_count, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale));
}

void step_many(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
               const std::vector<int>& grad_dtypes, const std::vector<uintptr_t>& exp_avgs,
               const std::vector<uintptr_t>& exp_avg_sqs, const std::vector<uintptr_t>& out16s,
               const std::vector<int>& out_dtypes, const std::vector<int64_t>& numels,
               const std::vector<int64_t>& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, double grad_scale) {
    const size_t count = params.size();
    for (size_t size : {grads.size(), grad_dtypes.size(), exp_avgs.size(), exp_avg_sqs.size(),
                        out16s.size(), out_dtypes.size(), numels.size(), steps.size()}) {
        if (size != count) {
            throw_error<std::invalid_argument>("step_many: all lists need one entry per tensor");
        }
    }
    std::vector<adam::AdamBuffers> buffers;
    std::vector<adam::AdamHyper> hypers;
    buffers.reserve(count);
    hypers.reserve(count);
    for (size_t i = 0; i < count; ++i) {
        buffers.push_back(make_buffers(params[i], grads[i], grad_dtypes[i], exp_avgs[i],
                                       exp_avg_sqs[i], out16s[i], out_dtypes[i], numels[i]));
        hypers.push_back(make_hyper(steps[i], lr, beta1, beta2, eps, weight_decay, adamw, grad_scale));
    }
    adam::adam_step_many(buffers, hypers);
}

std::vector<std::string> available_isas() {
    std::vector<std::string> out;
    for (simd::Isa isa : simd::available_isas()) out.emplace_back(simd::isa_name(isa));
    return out;
}

}  // namespace

void bind_adam(py::module_& m) {
    // The native contract (simd/formats.hpp, simd/bandwidth.hpp), read by infinity/_native/adam.py.
    m.attr("dtype_codes") = dtype_codes(false);
    m.attr("out16_dtype_codes") = dtype_codes(true);
    py::dict kernels;
    kernels["triad"] = static_cast<int>(simd::BandwidthKernel::kTriad);
    kernels["axpy"] = static_cast<int>(simd::BandwidthKernel::kAxpy);
    kernels["adam_pattern"] = static_cast<int>(simd::BandwidthKernel::kAdamPattern);
    kernels["adam_prefetch"] = static_cast<int>(simd::BandwidthKernel::kAdamPatternPrefetch);
    m.attr("bandwidth_kernels") = kernels;
    py::dict formats;
    py::dict format_bytes;
    for (const simd::StateFormatInfo& f : simd::kStateFormats) {
        formats[f.name] = static_cast<int>(f.code);
        format_bytes[f.name] = f.element_bytes;
    }
    m.attr("state_formats") = formats;
    m.attr("state_element_bytes") = format_bytes;
    m.attr("QBLOCK") = simd::kQBlock;

    m.def("step", &step, py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out16"),
          py::arg("out_dtype"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
          py::arg("grad_scale"), py::arg("state_format") = 0, py::arg("exp_avg_scale") = 0,
          py::arg("exp_avg_sq_scale") = 0, py::arg("round_stream") = 0, py::arg("round_offset") = 0,
          "Fused Adam/AdamW step over raw, validated buffers (dtype codes: 0 fp32, 1 bf16, 2 "
          "fp16; out16=0 for none; state_format from state_formats, int8 with the two block-"
          "scale buffers; bf16 moments: element i is element round_offset + i of stream "
          "round_stream for the stochastic rounding's random bits). Releases the GIL.");
    m.def(
        "q8_encode_moments",
        [](uintptr_t m, uintptr_t v, uintptr_t m_code, uintptr_t m_scale, uintptr_t v_code,
           uintptr_t v_scale, int64_t n) {
            adam::q8_encode_moments(as_ptr<const float>(m), as_ptr<const float>(v),
                                    as_ptr<uint8_t>(m_code), as_ptr<float>(m_scale),
                                    as_ptr<uint8_t>(v_code), as_ptr<float>(v_scale),
                                    to_count(n, "q8_encode_moments"));
        },
        py::call_guard<py::gil_scoped_release>(), py::arg("m"), py::arg("v"), py::arg("m_code"),
        py::arg("m_scale"), py::arg("v_code"), py::arg("v_scale"), py::arg("n"),
        "Encode n fp32 moments into int8 codes and block scales, as the kernel stores them.");
    m.def(
        "q8_decode",
        [](uintptr_t code, uintptr_t scale, uintptr_t out, int64_t n, bool is_signed) {
            adam::q8_decode(as_ptr<const uint8_t>(code), as_ptr<const float>(scale),
                            as_ptr<float>(out), to_count(n, "q8_decode"), is_signed);
        },
        py::call_guard<py::gil_scoped_release>(), py::arg("code"), py::arg("scale"), py::arg("out"),
        py::arg("n"), py::arg("is_signed"),
        "Decode n int8 codes of one moment (is_signed: exp_avg) into fp32.");
    m.def("step_many", &step_many, py::call_guard<py::gil_scoped_release>(), py::arg("params"),
          py::arg("grads"), py::arg("grad_dtypes"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("out16s"), py::arg("out_dtypes"), py::arg("numels"), py::arg("steps"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("adamw"), py::arg("grad_scale"),
          "step() over several tensors in one pool dispatch: one list entry per tensor, shared "
          "hyper-parameters, per-tensor step counts. Releases the GIL.");
    m.def("available_isas", &available_isas, "ISAs this CPU can run, widest first.");
    m.def("active_isa", [] { return std::string(simd::isa_name(simd::active_isa())); },
          "The ISA the next step uses.");
    m.def("force_isa", &simd::force_isa, py::arg("name"),
          "Force an ISA by name; None returns to automatic choice.");
    m.def("set_num_threads", &set_compute_threads, py::arg("n"),
          "Threads of the compute pool (0 = default).");
    m.def("get_num_threads", &compute_threads, "Threads of the compute pool.");
    m.def("default_num_threads", &default_num_threads,
          "Physical cores among the CPUs this process may run on (capped at 64).");
    m.def(
        "bandwidth_probe",
        [](int kind, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int64_t n) {
            if (kind < 0 || kind > static_cast<int>(simd::BandwidthKernel::kAdamPatternPrefetch)) {
                throw_error<std::invalid_argument>("bandwidth_probe: unknown kernel");
            }
            return simd::bandwidth_probe(static_cast<simd::BandwidthKernel>(kind), as_ptr<float>(a),
                                         as_ptr<float>(b), as_ptr<float>(c), as_ptr<float>(d), n);
        },
        py::call_guard<py::gil_scoped_release>(), py::arg("kind"), py::arg("a"), py::arg("b"),
        py::arg("c"), py::arg("d"), py::arg("n"),
        "One pass of a bandwidth loop (0 triad, 1 axpy, 2 Adam pattern, 3 Adam pattern with "
        "prefetch) over n floats on the compute pool; returns bytes moved (STREAM convention).");
}

}  // namespace infinity
