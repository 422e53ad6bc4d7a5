"""A real, small file system (tmpfs) that tests fill up: the disk-full cases without any fake."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHUNK = bytes(1 << 20)


@contextmanager
def small_disk(folder: Path, size_mb: int, inodes: int | None = None) -> Iterator[Path]:
    """Mount a tmpfs of ``size_mb`` MB (and ``inodes`` files and folders, if given) on ``folder``
    for the duration; skip the test where the machine does not allow it (not root, no mount
    permission in the container)."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mb}m" + (f",nr_inodes={inodes}" if inodes is not None else "")
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # Lazy: a process that still has a file open there (a broker being stopped) cannot block it.
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10, check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file (returned: delete it to free the space)."""
    filler = disk / "filler"
    chunk = CHUNK
    with filler.open("wb", buffering=0) as out:
        while chunk:  # halved at each "no space left", down to a single byte: bounded
            try:
                out.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
    assert os.statvfs(disk).f_bavail == 0, "the disk still has free blocks"
    return filler


def free_bytes(disk: Path) -> int:
    stats = os.statvfs(disk)
    return stats.f_bavail * stats.f_frsize


def leave_free(disk: Path, filler: Path, size: int) -> None:
    """Shrink ``filler`` (from ``fill``) so that ``disk`` has ``size`` bytes free (to a page)."""
    os.truncate(filler, filler.stat().st_size - (size - free_bytes(disk)))
    assert abs(free_bytes(disk) - size) <= 8192, (free_bytes(disk), size)


def remount_read_only(disk: Path) -> None:
    """Make the tmpfs at ``disk`` read-only (a disk the kernel remounted so after errors)."""
    done = subprocess.run(
        ["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True, timeout=10, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {done.stderr.strip()}")
