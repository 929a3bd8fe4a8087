// Shared by the fence device's three files: memory.cpp (allocation, aliases between
// host and device views of one memory), kernels.cpp (the device check, the fallback,
// the registered kernels) and device.cpp (guard, hooks, the Python module).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>

namespace infinity_fence {

constexpr c10::DeviceType kFence = c10::DeviceType::PrivateUse1;
inline const c10::Device kFenceDevice(kFence, 0);
constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);
constexpr size_t kAlignment = 4096;  // O_DIRECT reads may land in device slots
// CUDA's caching allocator holds every block in multiples of 512 bytes; the fence
// counts its blocks as CUDA does (infinity.utils.process_memory.DEVICE_BLOCK_BYTES),
// so a forecast that sums tensors' own bytes fails on the CPU as it would on a GPU.
constexpr int64_t kCountedBlock = 512;

// memory.cpp
c10::Allocator& allocator();
int64_t memory_allocated();
int64_t max_memory_allocated();
void reset_peak();
bool is_fence(const at::Tensor& t);
at::Tensor adopt(const at::Tensor& cpu);
at::Tensor host_alias(const at::Tensor& fence);
at::Tensor fence_view(const at::Tensor& base, const at::Tensor& host_view);
void resize_bytes(c10::StorageImpl* storage, size_t nbytes);

// kernels.cpp
void route_cpu_kernels();

}  // namespace infinity_fence
