// RAII owner of an aligned heap allocation (posix_memalign / free).
#pragma once

#include <cstdlib>
#include <memory>
#include <new>

namespace infinity {

struct FreeDeleter {
    void operator()(void* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeDeleter>;

/// `size` bytes aligned to `alignment` (a power of two, multiple of sizeof(void*)).
inline AlignedBuffer make_aligned_buffer(std::size_t size, std::size_t alignment) {
    void* p = nullptr;
    if (::posix_memalign(&p, alignment, size) != 0) throw std::bad_alloc();
    return AlignedBuffer(static_cast<char*>(p));
}

}  // namespace infinity
