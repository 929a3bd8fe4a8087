// The fence device to torch: its device guard, its accelerator hooks, and the
// Python module ``infinity._fence`` (loading it registers everything in
// memory.cpp and kernels.cpp; ``register_hooks`` finishes the registration).
// See NOTE [the fence device].

#include <ATen/ATen.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <Python.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <exception>

#include "fence/fence.hpp"

namespace infinity_fence {
namespace {

// One device, index 0, one stream. Kernels run synchronously on the calling
// thread, so events are complete when recorded.
struct FenceGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kFence; }
  c10::Device exchangeDevice(c10::Device) const override { return kFenceDevice; }
  c10::Device getDevice() const override { return kFenceDevice; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFenceDevice);
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, kFenceDevice);
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFenceDevice);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FenceGuard);

struct FenceHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    // NOTE: kernels run on the CPU with its generator, so random ops on the
    // fence draw the same numbers as on the host.
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return kFenceDevice; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

PyObject* memory_allocated(PyObject*, PyObject*) {
  return PyLong_FromLongLong(infinity_fence::memory_allocated());
}
PyObject* max_memory_allocated(PyObject*, PyObject*) {
  return PyLong_FromLongLong(infinity_fence::max_memory_allocated());
}
PyObject* reset_peak(PyObject*, PyObject*) {
  infinity_fence::reset_peak();
  Py_RETURN_NONE;
}

PyObject* register_hooks(PyObject*, PyObject*) {
  static FenceHooks hooks;
  if (!at::isPrivateUse1HooksRegistered()) {
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
  try {
    route_cpu_kernels();
  } catch (const std::exception& exc) {
    PyErr_SetString(PyExc_RuntimeError, exc.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"memory_allocated", memory_allocated, METH_NOARGS, "Bytes held by fence tensors now."},
    {"max_memory_allocated", max_memory_allocated, METH_NOARGS,
     "Most bytes held by fence tensors since the last reset."},
    {"reset_peak_memory_stats", reset_peak, METH_NOARGS, "Start the peak from now."},
    {"register_hooks", register_hooks, METH_NOARGS, "Register the device's accelerator hooks."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_fence", "The fence test device's kernels.", -1,
                       kMethods};

}  // namespace
}  // namespace infinity_fence

PyMODINIT_FUNC PyInit__fence() { return PyModule_Create(&infinity_fence::kModule); }
