#include "io/file_ops.hpp"

#include <fcntl.h>

#include "common/error.hpp"

namespace infinity::io {

void preallocate(int fd, std::uint64_t nbytes, const std::string& path) {
    if (nbytes == 0) return;
    auto len = static_cast<off_t>(nbytes);
    int r;
    do {
        r = ::fallocate(fd, 0, 0, len);
    } while (r != 0 && errno == EINTR);
    if (r == 0) return;
    int err = errno;
    if (err != EOPNOTSUPP && err != ENOSYS) {
        throw SystemError("fallocate of " + std::to_string(nbytes) + " bytes for '" + path + "'", err);
    }
    // NOTE: posix_fallocate returns the error instead of setting errno; on file
    // systems without fallocate glibc emulates it by writing every block.
    err = ::posix_fallocate(fd, 0, len);
    if (err != 0) {
        throw SystemError("posix_fallocate of " + std::to_string(nbytes) + " bytes for '" + path + "'",
                          err);
    }
}

}  // namespace infinity::io
