// The fence device's memory: a test device that stands for a GPU on a machine
// without one (PyTorch's PrivateUse1 backend, renamed "fence" from Python in
// infinity/devices/fence.py). See NOTE [the fence device].
//
// Its memory is host memory, 4 KiB aligned, counted as device bytes in CUDA's
// 512-byte blocks. A host view
// of a fence tensor (host_alias) and a fence view of a CPU kernel's result
// (adopt, fence_view) share the memory, never copy it: that is how kernels.cpp
// runs the CPU's kernels on the device's tensors.
//
// These files link against libtorch (unlike infinity._C, which is plain C++):
// they are built only where torch is importable at build time (setup.py).

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "fence/fence.hpp"

namespace infinity_fence {
namespace {

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};

// What an allocation of ``nbytes`` holds, as CUDA's caching allocator counts it.
int64_t counted(int64_t nbytes) { return (nbytes + kCountedBlock - 1) / kCountedBlock * kCountedBlock; }

void count(int64_t delta) {
  const int64_t now = g_allocated.fetch_add(delta) + delta;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// What a fence DataPtr owns: its own aligned block, or a CPU result's storage
// adopted without a copy. Either way its bytes count as device memory.
struct Block {
  void* owned = nullptr;
  c10::Storage adopted;
  int64_t nbytes = 0;
};

void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  count(-block->nbytes);
  std::free(block->owned);
  delete block;
}

struct FenceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    if (nbytes > 0) {
      const int rc = posix_memalign(&data, kAlignment, nbytes);
      TORCH_CHECK(rc == 0, "fence: cannot allocate ", nbytes, " bytes (", std::strerror(rc), ")");
    }
    auto* block = new Block{data, {}, counted(static_cast<int64_t>(nbytes))};
    count(block->nbytes);
    return {data, block, &release, kFenceDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

FenceAllocator g_allocator;
REGISTER_ALLOCATOR(kFence, &g_allocator);

}  // namespace

// A fence tensor over a CPU tensor's memory, keeping its storage alive.
at::Tensor adopt(const at::Tensor& cpu) {
  c10::Storage storage = cpu.storage();
  const auto nbytes = static_cast<int64_t>(storage.nbytes());
  void* data = storage.mutable_data();
  auto* block = new Block{nullptr, storage, counted(nbytes)};
  count(block->nbytes);
  c10::Storage fence_storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                             c10::DataPtr(data, block, &release, kFenceDevice), &g_allocator,
                             /*resizable=*/true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(fence_storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                   cpu.storage_offset());
  return out;
}

// A host tensor over a fence tensor's memory (same sizes, strides and dtype).
at::Tensor host_alias(const at::Tensor& fence) {
  if (fence.storage().data() == nullptr) {  // no memory yet (zero elements)
    return at::empty_strided(fence.sizes(), fence.strides(), fence.options().device(at::kCPU));
  }
  return at::from_blob(fence.mutable_data_ptr(), fence.sizes(), fence.strides(),
                       fence.options().device(at::kCPU));
}

// A fence view of ``base``'s storage with the shape of ``host_view``, a view that
// a CPU kernel made of ``base``'s host alias.
at::Tensor fence_view(const at::Tensor& base, const at::Tensor& host_view) {
  const auto* start = static_cast<const char*>(base.storage().data());
  const auto* at_view = static_cast<const char*>(host_view.storage().data()) +
                        host_view.storage_offset() * host_view.element_size();
  const int64_t offset = (at_view - start) / static_cast<int64_t>(host_view.element_size());
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), host_view.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(host_view.sizes(), host_view.strides(),
                                                   offset);
  return out;
}

bool is_fence(const at::Tensor& t) { return t.defined() && t.device().type() == kFence; }

void resize_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "fence: trying to resize a storage that is not resizable");
  c10::DataPtr fresh = g_allocator.allocate(nbytes);
  const size_t keep = std::min(nbytes, storage->nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), storage->data(), keep);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

c10::Allocator& allocator() { return g_allocator; }
int64_t memory_allocated() { return g_allocated.load(); }
int64_t max_memory_allocated() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_allocated.load()); }

}  // namespace infinity_fence
