"""Files in shared memory that belong to one process: named ``<prefix><pid>-<random>`` after the process
that made them, which holds an exclusive ``flock`` on each while it runs (the kernel drops the lock when
that process dies, however it dies). A file whose process is gone and whose lock is free is stale, and
``remove_stale`` deletes it: the emulated ranks' heaps and rendezvous files, the agreement segments."""

from __future__ import annotations

import fcntl
import os
import re
import tempfile


def shm_dir() -> str:
    """``/dev/shm`` where it is writable, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def make_owned(prefix: str, directory: str | None = None) -> tuple[str, int]:
    """A new file ``<prefix><this pid>-<random>`` and its descriptor, locked by this process (keep the
    descriptor open while the file is in use), after removing the stale files of ``prefix``."""
    directory = directory or shm_dir()
    remove_stale(prefix, directory)
    fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=directory)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, fd


def remove_stale(prefix: str, directory: str | None = None) -> list[str]:
    """Delete the files of ``prefix`` (``<prefix><pid>-...``, with any suffix) whose process is not
    running and whose lock nobody holds; return their paths. Files named otherwise are left alone."""
    directory = directory or shm_dir()
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[^/]+")
    removed = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match is None or process_alive(int(match[1])):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # locked: its owner lives (in another pid namespace), or another cleaner got there first
        finally:
            os.close(fd)
    return removed


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
