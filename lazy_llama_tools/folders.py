"""Writing a folder atomically (build it in a hidden temporary folder beside the target, then put it in place),
and the signal handling that goes with it.

What holds, for a target folder `T` (hidden names live beside it, in the same file system):

- `lock_target(T)` takes an exclusive lock (`fcntl.flock` on `.T.lock`): two writers of the same `T` cannot
  overlap; the second is told which process holds it. The kernel drops the lock when its holder dies, even
  by SIGKILL, so a stale lock file never blocks anyone.
- `temporary_folder(T)` creates `.T.tmp-PID-XXXX`; only the lock holder creates these, so under the lock every
  one that exists was left by a run that died (SIGKILL, power loss): `remove_leftovers(T)` removes them.
- `publish_folder(tmp, T, replace=...)` moves the complete `tmp` to `T` by renames only. Without `replace` it
  refuses a non-empty `T` (the rename itself refuses, so two writers cannot both win). With `replace` on
  Linux it swaps `tmp` and `T` in one `renameat2(RENAME_EXCHANGE)` call, so at every instant `T` is the old or
  the new folder; elsewhere it renames `T` to `.T.old-PID` then `tmp` to `T`, and `remove_leftovers` puts a
  `.T.old-*` back if a run died between the two.
- `deferred_signals()` holds Ctrl-C, SIGTERM and SIGHUP back while a block runs and delivers them after, so
  the caller can finish a swap (and know that it finished) before it is interrupted.
- `terminations_as_interrupts()` makes SIGTERM and SIGHUP (a closed terminal) raise `KeyboardInterrupt` like
  Ctrl-C, so one clean-up path serves all three, and notes every such signal: `raise_swallowed_interrupt()`, called
  before publishing, raises again one whose `KeyboardInterrupt` Python swallowed (it ignores exceptions raised in a
  weakref callback or a `__del__`, where a signal can land).
"""

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

INTERRUPT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


class FolderBusy(RuntimeError):
    """Another process holds the lock of the target folder."""


def _hidden(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}"


@contextmanager
def lock_target(target: Path) -> Iterator[None]:
    """Hold the exclusive lock of `target` for the block; `FolderBusy` at once if another process holds it.

    The lock file `.NAME.lock` (beside `target`, holding the owner's pid) is removed on release. A holder that
    dies leaves the file, but not the lock: the next caller takes it over.
    """
    path = _hidden(target, "lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderBusy(f"another process (pid {owner}) is writing {target}; wait for it to finish") from None
        try:  # the previous holder may have removed the file between our open and our lock: lock the new one
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.unlink(path)  # while still holding the lock, so nobody locks a file that is about to vanish
        os.close(fd)


def temporary_folder(target: Path) -> Path:
    """A new empty hidden folder `.NAME.tmp-PID-XXXX` beside `target`, for the lock holder to fill."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))


def remove_leftovers(target: Path) -> list[str]:
    """Under the lock of `target`: remove the temporary folders of runs that died, and put back a previous
    `target` that a run died while replacing (possible only where `RENAME_EXCHANGE` is missing).
    Returns one line per action, for the log."""
    done = []
    pattern = glob.escape(f".{target.name}")
    for path in sorted(target.parent.glob(f"{pattern}.tmp-*")):
        _remove(path)
        done.append(f"removed {path.name}, left by an interrupted run")
    old = sorted(target.parent.glob(f"{pattern}.old-*"))
    if old and not os.path.lexists(target):
        os.rename(old.pop(), target)
        done.append(f"restored {target.name}, which an interrupted run had moved aside")
    for path in old:
        _remove(path)
        done.append(f"removed {path.name}, left by an interrupted run")
    return done


def write_text_whole(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to a hidden file beside `path`, then rename it into place: a failed or interrupted write
    leaves `path` as it was and no temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.stem}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def publish_folder(tmp: Path, target: Path, *, replace: bool = False) -> bool:
    """Move the complete folder `tmp` to `target` (same file system; see the module docstring).

    Returns False, with `tmp` removed and `target` untouched, when `target` is not empty and `replace` is
    False. With `replace`, an existing `target` is removed after the new folder is in place. Run it under
    `deferred_signals()` to keep Ctrl-C from interrupting between the renames and the removal.
    """
    if not os.path.lexists(target) or is_empty_folder(target):
        try:
            os.rename(tmp, target)  # POSIX: replaces an empty folder, refuses a non-empty one
            return True
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # another writer (or a user) filled `target` a moment ago
    if not replace:
        _remove(tmp)
        return False
    if _exchange(tmp, target):
        _remove(tmp)  # now the previous `target`
        return True
    old = _hidden(target, f"old-{os.getpid()}")
    os.rename(target, old)
    os.rename(tmp, target)
    _remove(old)
    return True


@contextmanager
def deferred_signals(signals=INTERRUPT_SIGNALS) -> Iterator[None]:
    """Hold `signals` back while the block runs, then deliver them (the previous handlers act as usual).

    Only the main thread can handle signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received, previous = [], {}
    try:
        for number in signals:
            handler = signal.signal(number, lambda signum, frame: received.append(signum))
            previous[number] = signal.SIG_DFL if handler is None else handler
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(received):
            signal.raise_signal(number)


_SIGNALS_NOTED: list[int] = []  # signals `terminations_as_interrupts` turned into KeyboardInterrupt


@contextmanager
def terminations_as_interrupts() -> Iterator[None]:
    """In the block, SIGTERM and SIGHUP raise `KeyboardInterrupt` (in the main thread) as Ctrl-C does, and each of
    the three is noted for `raise_swallowed_interrupt()`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    _SIGNALS_NOTED.clear()
    try:
        for number in INTERRUPT_SIGNALS:
            if number != signal.SIGINT or signal.getsignal(number) is signal.default_int_handler:
                previous[number] = signal.signal(number, _raise_keyboard_interrupt)
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _raise_keyboard_interrupt(signum, frame):
    _SIGNALS_NOTED.append(signum)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def raise_swallowed_interrupt() -> None:
    """Raise `KeyboardInterrupt` if a signal arrived in `terminations_as_interrupts()` and the run still goes on:
    Python swallowed its exception (one raised in a weakref callback or a `__del__` is only printed). Call it before
    publishing, so that an interrupted run publishes nothing."""
    if _SIGNALS_NOTED:
        signum = _SIGNALS_NOTED[0]
        _SIGNALS_NOTED.clear()
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name} (raised again: it was swallowed)")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`); False where that is not available."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # old kernel, or a file system without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
