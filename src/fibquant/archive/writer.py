"""One writer per store, and stores that appear only once complete (docs/archive-format.md).

A store is an archive file, a code-archive directory or a saved KV cache directory. Every
writer (create, overwrite, append, crash repair) first takes `WriterLock(target)`: an
exclusive, non-blocking `fcntl.flock` on the sibling file `.NAME.lock`. A second writer is
refused at once with `StoreLockedError` naming the store; readers take no lock and are never
blocked. The kernel drops the lock when its process dies, so a killed writer leaves at most
a stale (unlocked) lock file, which the next writer reuses.

A new store is built under the sibling name `.NAME.tmp-PID` (`WriterLock.building`) and put
in place by `publish` once complete: a failed or killed create leaves nothing at NAME, and
`overwrite` replaces the old store only then (a file by one atomic rename; a directory by
moving the old one aside to `.NAME.old-PID`, renaming the new one in, deleting the old).
Leftovers of a killed writer (`.NAME.tmp-*`, `.NAME.old-*`) are cleared by the next writer
under the lock (an old store whose replacement never arrived is moved back).
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from .format import ArchiveError


class StoreLockedError(ArchiveError):
    """Another process is writing this store (it holds the writer lock)."""


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_directory(path: Path) -> None:
    """fsync a directory, so that the files created in it survive a power loss (POSIX only)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(handle)


class WriterLock:
    """The writer lock of the store at `target`; `acquire` takes it (non-blocking), `release` drops it."""

    def __init__(self, target: Path, lock_path: Path, fd: int):
        self.target, self.lock_path, self._fd = target, lock_path, fd

    @classmethod
    def acquire(cls, target) -> "WriterLock":
        target = Path(target)
        if not target.parent.is_dir():
            raise ArchiveError(f"{target}: the folder {target.parent} does not exist")
        lock_path = target.parent / f".{target.name}.lock"
        for _ in range(8):  # the holder may delete the file between our open and our flock: retry
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ArchiveError(f"cannot write {target}: {exc.strerror} ({lock_path})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreLockedError(f"{target} is being written by another process (it holds {lock_path}): "
                                       "one writer at a time; readers may open it meanwhile") from None
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                lock = cls(target, lock_path, fd)
                lock._clear_leftovers()
                return lock
            os.close(fd)  # we locked a file its holder had just removed
        raise StoreLockedError(f"{target}: could not take the writer lock {lock_path}")

    def _clear_leftovers(self) -> None:
        """Remove what a killed writer left: its unfinished new store; an old store moved aside
        whose replacement never arrived goes back in place."""
        parent, name = self.target.parent, self.target.name
        for old in sorted(parent.glob(f".{name}.old-*")):
            if not self.target.exists():
                os.replace(old, self.target)
            else:
                _remove(old)
        for tmp in parent.glob(f".{name}.tmp-*"):
            _remove(tmp)

    def building(self) -> Path:
        """Where a new store for `target` is built before `publish` (absent now)."""
        tmp = self.target.parent / f".{self.target.name}.tmp-{os.getpid()}"
        _remove(tmp)
        return tmp

    def publish(self, built: Path, durable: bool = False) -> None:
        """Put the complete store `built` at `target`, replacing what is there."""
        target = self.target
        if built.is_dir() and target.exists():
            aside = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, aside)
            os.replace(built, target)
            _remove(aside)
        else:
            os.replace(built, target)
        if durable:
            fsync_directory(target.parent)

    def discard(self, built: Path) -> None:
        """Remove an unpublished store (a failed create)."""
        _remove(built)

    def finish(self, built: Path | None, outcome: str, durable: bool = False) -> None:
        """End a writer: `outcome` "publish" (`publish(built)`), "discard" (`discard(built)`) or "keep"
        (`built` is the target itself, or nothing was built), then `release` (also when that fails)."""
        try:
            if built is not None and outcome == "publish":
                self.publish(built, durable)
            elif built is not None and outcome == "discard":
                self.discard(built)
        finally:
            self.release()

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.lock_path)  # still ours: removed while locked, so no one else holds it
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def check_new_store(target: Path, overwrite: bool, kind: str) -> None:
    """Refuse to create a store where one exists (without overwrite) or where a store of another
    kind (a file for a directory store, or the reverse) would be replaced."""
    if not target.exists():
        return
    is_dir = kind == "directory"
    if target.is_dir() != is_dir:
        raise ArchiveError(f"{target} is a {'directory' if target.is_dir() else 'file'}, not a "
                           f"{'store directory' if is_dir else 'file'}: refusing to replace it")
    if not overwrite:
        raise ArchiveError(f"{target} exists (pass overwrite=True to replace it)")
