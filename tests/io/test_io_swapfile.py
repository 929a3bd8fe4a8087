"""SwapFile: private, preallocated, removed on close / GC / exit; clear errors for bad places."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import stat
import warnings

import pytest
from io_helpers import file_bytes, mounted_tmpfs, random_tensor, run_python

from infinity.io import SwapFile, aligned_empty
from infinity.io import swapfile as swapfile_module

PAGE = 4096


def test_permissions_and_preallocation(engine, tmp_path):
    with SwapFile(tmp_path, 3 << 20, engine, name="opt") as sf:
        st = os.stat(sf.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(sf.directory).st_mode) == 0o700
        assert os.path.dirname(sf.path) == sf.directory
        assert os.path.dirname(sf.directory) == str(tmp_path)
        assert os.path.basename(sf.path) == "opt.bin"
        assert st.st_size == 3 << 20 == sf.nbytes
        assert st.st_blocks * 512 >= 3 << 20  # blocks reserved, not a sparse file
        assert sf.direct
        assert os.fstat(sf.fileno()).st_ino == st.st_ino
        assert os.O_DIRECT & __import__("fcntl").fcntl(sf.fileno(), __import__("fcntl").F_GETFL)
    assert not os.path.exists(sf.path) and not os.path.exists(sf.directory)
    assert os.listdir(tmp_path) == []


def test_two_swapfiles_get_separate_private_dirs(engine, tmp_path):
    with SwapFile(tmp_path, PAGE, engine) as a, SwapFile(tmp_path, PAGE, engine) as b:
        assert a.directory != b.directory and a.path != b.path


def test_own_engine_when_none_given(tmp_path):
    with SwapFile(tmp_path, 8 * PAGE) as sf:
        t, expected = random_tensor(8 * PAGE, seed=1)
        assert sf.write(t, 0).wait() == 8 * PAGE
        assert file_bytes(sf.path, 0, 8 * PAGE) == expected
        engine = sf.engine
    assert engine.closed


def test_close_waits_for_pending_transfers(engine, tmp_path):
    sf = SwapFile(tmp_path, 32 * PAGE, engine)
    engine.inject_delay(100_000)
    t, _ = random_tensor(32 * PAGE, seed=2)
    req = sf.write(t, 0)
    sf.close()
    assert req.done() and req.wait() == 32 * PAGE
    assert not os.path.exists(sf.path)


def test_removed_when_garbage_collected(engine, tmp_path):
    sf = SwapFile(tmp_path, PAGE, engine)
    path, directory = sf.path, sf.directory
    del sf
    gc.collect()
    assert not os.path.exists(path) and not os.path.exists(directory)


@pytest.mark.parametrize("in_flight", [False, True])
def test_removed_at_interpreter_exit(tmp_path, in_flight):
    """A SwapFile never closed (even with a write in flight) is gone after the process exits."""
    code = f"""
import sys
from infinity.io import IOEngine, SwapFile, aligned_empty
eng = IOEngine()
sf = SwapFile({str(tmp_path)!r}, 1 << 20, eng)
print(sf.path, flush=True)
if {in_flight}:
    eng.inject_delay(200_000)
    sf.write(aligned_empty(1 << 20), 0)
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path.startswith(str(tmp_path))
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_directory_is_created_when_parent_exists(engine, tmp_path):
    target = tmp_path / "new"
    with SwapFile(target, PAGE, engine) as sf:
        assert sf.directory.startswith(str(target))
    assert target.is_dir()


def test_missing_parent_is_a_clear_error(tmp_path):
    target = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError, match=r"its parent '.*/no/such' does not exist"):
        SwapFile(target, PAGE)


def test_not_a_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"'.*/file' exists and is not a directory"):
        SwapFile(tmp_path / "file", PAGE)
    with pytest.raises(NotADirectoryError, match=r"'.*/file' is not a directory"):
        SwapFile(tmp_path / "file" / "sub", PAGE)


def test_read_only_directory_by_permissions(tmp_path):
    if os.geteuid() == 0:
        pytest.skip(
            "running as root: chmod 0555 does not stop root from writing "
            "(test_read_only_file_system covers read-only places instead)"
        )
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"private directory in '{ro}'"):
            SwapFile(ro, PAGE)
    finally:
        ro.chmod(0o755)


def test_read_only_file_system(tmp_path):
    with mounted_tmpfs(tmp_path / "rofs", "ro,size=1M") as mnt:
        with pytest.raises(OSError) as info:
            SwapFile(mnt, PAGE)
        assert info.value.errno == errno.EROFS
        assert str(mnt) in str(info.value) and "Read-only file system" in str(info.value)
        with pytest.raises(OSError, match=r"cannot create swap directory '.*/rofs/sub'"):
            SwapFile(mnt / "sub", PAGE)


def test_buffered_fallback_when_o_direct_is_refused(engine, tmp_path, monkeypatch):
    """A file system that rejects O_DIRECT (EINVAL) gets buffered I/O, a warning, direct=False."""
    real_open = os.open

    def open_without_direct(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(swapfile_module.os, "open", open_without_direct)
    monkeypatch.setattr(swapfile_module, "_warned_buffered", set())
    with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
        sf = SwapFile(tmp_path, 8 * PAGE, engine)
    with sf:
        assert not sf.direct
        # O_DSYNC: each write reports its own write-back error (no fsync needed).
        assert fcntl.fcntl(sf.fileno(), fcntl.F_GETFL) & os.O_DSYNC == os.O_DSYNC
        t, expected = random_tensor(8 * PAGE, seed=3)
        sf.write(t, 0).wait()
        assert file_bytes(sf.path, 0, 8 * PAGE) == expected
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the warning is given once per place
            SwapFile(tmp_path, PAGE, engine).close()


def test_bad_sizes_and_names(tmp_path):
    with pytest.raises(ValueError, match="positive multiple of 4096"):
        SwapFile(tmp_path, 5000)
    with pytest.raises(ValueError, match="positive multiple of 4096"):
        SwapFile(tmp_path, 0)
    with pytest.raises(ValueError, match="is not a size"):
        SwapFile(tmp_path, "lots")
    with pytest.raises(ValueError, match="plain file name"):
        SwapFile(tmp_path, PAGE, name="../escape")
    assert os.listdir(tmp_path) == []


def test_size_strings_are_accepted(engine, tmp_path):
    with SwapFile(tmp_path, "64KiB", engine) as sf:
        assert sf.nbytes == 64 << 10
        buf = aligned_empty(PAGE)
        assert sf.read(buf, 60 << 10).wait() == PAGE  # preallocated blocks read as zeros
        assert buf.count_nonzero() == 0
