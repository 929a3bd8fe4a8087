// The fence device's kernels: see NOTE [the fence device] and memory.cpp.
//
// One boxed fallback serves every operator: it checks the devices of the
// arguments as CUDA's kernels do, runs the CPU kernel on host tensors that alias
// the same memory (no copy: a mutation lands in place), and hands the results
// back as fence tensors over the CPU results' memory (again no copy); views come
// back as views of the argument's storage. Allocation, copies across the
// boundary, resize, set_ and the pure-metadata view ops are registered directly.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fence/fence.hpp"

namespace infinity_fence {
namespace {

// --- the device check -------------------------------------------------------------------

// NOTE: CUDA's kernels accept a 0-dim host tensor as a scalar operand, and
// advanced indexing accepts host index tensors; everything else must be on the
// device. The message is CUDA's, with the fence's name and the fix.
[[noreturn]] void mixed(const c10::OperatorHandle& op, const std::string& argument,
                        const at::Tensor& t) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but got ", argument,
              " is on ", t.device(), ", different from other tensors on fence:0 (when checking ",
              "argument ", argument, " of ", op.schema().name(), "). The fence device stands ",
              "for a GPU: move host tensors to the engine's device with "
              "x.to(infinity.device_of(model))");
}

bool host_indices_allowed(const c10::OperatorHandle& op) {
  const auto& name = op.schema().name();
  return name == "aten::index" || name == "aten::index_put_" || name == "aten::_index_put_impl_";
}

at::Tensor to_host(const c10::OperatorHandle& op, const std::string& argument,
                   const at::Tensor& t, bool host_ok) {
  if (!t.defined()) {
    return t;
  }
  if (is_fence(t)) {
    return host_alias(t);
  }
  if (t.device().is_cpu() && (t.dim() == 0 || host_ok)) {
    return t;
  }
  mixed(op, argument, t);
}

struct Originals {
  std::vector<at::Tensor> fence;  // the fence tensors among the arguments
  at::Tensor base_of(const at::Tensor& host) const {
    if (!host.defined() || host.storage().data() == nullptr) {
      return {};
    }
    const auto* p = static_cast<const char*>(host.storage().data());
    for (const auto& f : fence) {
      const auto* start = static_cast<const char*>(f.storage().data());
      if (start != nullptr && p >= start && p < start + f.storage().nbytes()) {
        return f;
      }
    }
    return {};
  }
};

at::Tensor to_fence(const Originals& originals, const at::Tensor& host) {
  if (!host.defined() || is_fence(host)) {
    return host;
  }
  TORCH_CHECK(host.device().is_cpu(), "fence: a kernel returned a tensor on ", host.device());
  const at::Tensor base = originals.base_of(host);
  return base.defined() ? fence_view(base, host) : adopt(host);
}

// --- the fallback -----------------------------------------------------------------------

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  const std::vector<c10::IValue> saved(stack->begin() + first, stack->end());
  const bool host_ok = host_indices_allowed(op);
  Originals originals;
  // out= arguments get a fresh host tensor (the CPU kernel may resize it); the
  // result is copied into the fence tensor afterwards.
  std::vector<std::pair<at::Tensor, at::Tensor>> outs;

  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    const std::string& name = arguments[i].name();
    if (value.isTensor()) {
      const at::Tensor t = value.toTensor();
      if (is_fence(t)) {
        originals.fence.push_back(t);
      }
      if (arguments[i].is_out() && is_fence(t)) {
        at::Tensor host = at::empty({0}, t.options().device(at::kCPU));
        outs.emplace_back(t, host);
        value = host;
      } else {
        value = to_host(op, name, t, false);
      }
    } else if (value.isTensorList()) {
      const auto list = value.toTensorList();
      c10::List<at::Tensor> host;
      for (const at::Tensor t : list) {
        TORCH_CHECK(!(arguments[i].is_out() && is_fence(t)), "fence: out= lists are not ",
                    "supported (", schema.name(), ")");
        if (is_fence(t)) {
          originals.fence.push_back(t);
        }
        host.push_back(to_host(op, name, t, false));
      }
      value = host;
    } else if (value.isList()) {  // Tensor?[] (advanced indexing)
      const auto list = value.toList();
      bool tensors = false;
      c10::List<std::optional<at::Tensor>> host;
      for (size_t j = 0; j < list.size(); ++j) {
        const c10::IValue item = list.get(j);
        if (item.isTensor()) {
          tensors = true;
          const at::Tensor t = item.toTensor();
          if (is_fence(t)) {
            originals.fence.push_back(t);
          }
          host.push_back(to_host(op, name, t, host_ok));
        } else {
          host.push_back(std::nullopt);
        }
      }
      if (tensors) {
        value = host;
      }
    } else if (value.isDevice() && value.toDevice().type() == kFence) {
      value = c10::IValue(c10::Device(at::kCPU));
    }
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  for (auto& [fence, host] : outs) {
    if (!fence.sizes().equals(host.sizes())) {
      fence.resize_(host.sizes());
    }
    host_alias(fence).copy_(host);
  }
  const auto& returns = schema.returns();
  const size_t results = stack->size() - returns.size();
  for (size_t r = 0; r < returns.size(); ++r) {
    c10::IValue& value = (*stack)[results + r];
    const auto* alias = returns[r].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      // An in-place or out= result: the argument itself, as CUDA's kernels return it.
      for (size_t i = 0; i < arguments.size(); ++i) {
        const auto* arg_alias = arguments[i].alias_info();
        if (arg_alias != nullptr && arg_alias->beforeSets() == alias->beforeSets()) {
          value = saved[i];
          break;
        }
      }
      continue;
    }
    if (value.isTensor()) {
      value = to_fence(originals, value.toTensor());
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> fence;
      for (const at::Tensor t : value.toTensorList()) {
        fence.push_back(to_fence(originals, t));
      }
      value = fence;
    }
  }
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device>,
                               std::optional<bool>, std::optional<at::MemoryFormat> format) {
  return at::detail::empty_generic(size, &allocator(), kKeys, c10::dtype_or_default(dtype),
                                   format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &allocator(), kKeys,
                                           c10::dtype_or_default(dtype));
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (format.has_value() && *format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*format);
  }
  const size_t needed =
      at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.element_size(),
                                       self.storage_offset());
  if (self.numel() > 0 && needed > self.storage().nbytes()) {
    resize_bytes(self.storage().unsafeGetStorageImpl(), needed);
  }
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  const at::Tensor src_host = is_fence(self) ? host_alias(self) : self;
  const at::Tensor dst_host = is_fence(dst) ? host_alias(dst) : dst;
  TORCH_CHECK(src_host.device().is_cpu() && dst_host.device().is_cpu(),
              "fence: copy between ", self.device(), " and ", dst.device(), " is not supported");
  dst_host.copy_(src_host);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (!dst.sizes().equals(self.sizes())) {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kFence, "fence: set_ to a storage on ",
              source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {
    const auto contiguous = c10::contiguous_strides(size);
    impl->set_sizes_and_strides(size, contiguous, offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.element_size());
  return set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(),
                     source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, &allocator(), true);
  return set_storage(self, std::move(storage), 0, {0}, {});
}

// `param.data = x` between a host tensor and a fence tensor, as torch allows it
// between host and CUDA tensors (a parameter built on the host, then offloaded).
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && (t.device().is_cpu() || is_fence(t));
  };
  return plain(self) && plain(from);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  m.impl("set_.source_Storage", TORCH_FN(set_source_storage));
  m.impl("set_.source_Tensor", TORCH_FN(set_source_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
}

// A fence tensor over ``region``'s memory with a storage of its own (the
// DeviceBackend.alias contract): it owns nothing, the slab outlives it.
at::Tensor alias(const at::Tensor& region) {
  TORCH_CHECK(is_fence(region) && region.is_contiguous(), "alias needs a contiguous fence tensor");
  const size_t nbytes = region.numel() * region.element_size();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       c10::DataPtr(region.mutable_data_ptr(), kFenceDevice), nullptr,
                       /*resizable=*/false);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), kKeys,
                                                      caffe2::TypeMeta::Make<uint8_t>());
  out.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(nbytes)});
  return out;
}

TORCH_LIBRARY(infinity_fence, m) { m.def("alias(Tensor region) -> Tensor"); }

TORCH_LIBRARY_IMPL(infinity_fence, PrivateUse1, m) { m.impl("alias", TORCH_FN(alias)); }

// The fused attention choice is a dispatch stub, not an operator: without an
// entry for the device, scaled_dot_product_attention takes its math path there
// while the CPU takes flash attention (other arithmetic, other results).
int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& mask, double dropout, bool causal,
                   std::optional<double> scale, bool gqa) {
  std::optional<at::Tensor> host_mask;
  if (mask.has_value() && mask->defined()) {
    host_mask = is_fence(*mask) ? host_alias(*mask) : *mask;
  }
  return at::native::_fused_sdp_choice_cpp(host_alias(query), host_alias(key), host_alias(value),
                                           host_mask, dropout, causal, scale, gqa);
}

}  // namespace
}  // namespace infinity_fence

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &infinity_fence::sdp_choice)
}  // namespace at::native

namespace infinity_fence {

// NOTE: an operator with both a CPU kernel and a composite one (native_layer_norm,
// the fused attention choice, structured ops) would run the composite on the
// fence: other arithmetic than the CPU's, and other results. Every aten operator
// with a CPU kernel therefore gets the fallback as its fence kernel, so the fence
// runs the CPU's kernels and agrees with the host bit for bit.
void route_cpu_kernels() {
  static std::unique_ptr<torch::Library> library;
  if (library) {
    return;
  }
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const auto op = dispatcher.findOp(name);
    if (!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) {
      qualified += "." + name.overload_name;
    }
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

}  // namespace infinity_fence
