// RAII owner of an mmap()ed region (munmap on destruction).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <utility>

namespace infinity {

class MappedRegion {
  public:
    MappedRegion() noexcept = default;
    MappedRegion(void* addr, std::size_t size) noexcept : addr_(addr), size_(size) {}
    MappedRegion(const MappedRegion&) = delete;
    MappedRegion& operator=(const MappedRegion&) = delete;
    MappedRegion(MappedRegion&& other) noexcept
        : addr_(std::exchange(other.addr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
    MappedRegion& operator=(MappedRegion&& other) noexcept {
        if (this != &other) {
            release();
            addr_ = std::exchange(other.addr_, nullptr);
            size_ = std::exchange(other.size_, 0);
        }
        return *this;
    }
    ~MappedRegion() { release(); }

    /// The mapping's start address, or nullptr when empty.
    void* get() const noexcept { return addr_; }
    std::size_t size() const noexcept { return size_; }
    /// A pointer `offset` bytes into the mapping, typed as T.
    template <typename T>
    T* at(std::size_t offset) const noexcept {
        return reinterpret_cast<T*>(static_cast<char*>(addr_) + offset);
    }

  private:
    void release() noexcept {
        if (addr_ != nullptr) ::munmap(addr_, size_);
        addr_ = nullptr;
        size_ = 0;
    }
    void* addr_ = nullptr;
    std::size_t size_ = 0;
};

}  // namespace infinity
