"""The output file belongs to one run: checked before anything loads, locked for the whole run, and only
ever replaced atomically (from a temporary file private to the run) or appended to."""
from __future__ import annotations

import fcntl
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from tp_engine.base.config import ConfigError


def check_target(output: str, inputs: dict[str, str | None], model_dir: str) -> Path:
    """The file `output` names, with symlinks resolved: results are written there, so a symlink stays one.

    Refused: a path that ends in a slash, a file the run reads (`inputs`: what it is -> path), anything inside
    the model directory, an existing path that is not a regular file (a device, a FIFO, a pipe such as
    /dev/stdout may be, a directory) or that this user may not write, a folder this user may not write in (or
    create), and a name too long for the files the run writes beside it. Nothing is created here: a missing
    folder is made with the lock."""
    if output.endswith(("/", os.sep)):
        raise ConfigError(f"output {output} ends in '/': it must name a file")
    target = Path(os.path.realpath(output))
    for what, path in inputs.items():
        if path is not None and Path(os.path.realpath(path)) == target:
            raise ConfigError(
                f"output {output} is the {what}; results would overwrite it. Choose another output")
    model = Path(os.path.realpath(model_dir))
    if target.is_relative_to(model):
        raise ConfigError(f"output {output} is inside the model directory {model_dir}; choose another output")
    if os.path.exists(output):  # through links: /dev/stdout is what fd 1 is (a pipe, say), not a path
        mode = os.stat(output).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            shown = f" ({target})" if str(target) != output and os.path.lexists(target) else ""
            stdout = "" if stat.S_ISDIR(mode) else "; for stdout, leave 'output' unset or give \"-\""
            raise ConfigError(f"output {output} is {kind}{shown}; it must be a regular file (or a symlink to "
                              f"one){stdout}")
        if not os.access(target, os.W_OK):  # it would be replaced, then its appends refused
            raise ConfigError(f"output {output}: no permission to write {target}")
    folder = next(p for p in target.parents if os.path.lexists(p))  # the folder, or where its path starts
    if not folder.is_dir():
        raise ConfigError(
            f"output {output}: cannot create its folder {target.parent}: {folder} is not a directory")
    # every write goes through a temporary file and a rename there
    if not os.access(folder, os.W_OK | os.X_OK):
        what = "write in its folder" if folder == target.parent else f"create its folder {target.parent} in"
        raise ConfigError(f"output {output}: no permission to {what} {folder}")
    me, info = os.geteuid(), folder.stat()
    if info.st_mode & stat.S_ISVTX and me not in (0, info.st_uid):  # a sticky folder such as /tmp
        for path in (target, target.with_name(target.name + SETTINGS_SUFFIX)):
            if os.path.lexists(path) and os.lstat(path).st_uid != me:
                raise ConfigError(f"output {output}: {path} belongs to another user, and in {folder} "
                                  "(sticky) only its owner may replace it")
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    prefix = _temp_prefix(target.name + SETTINGS_SUFFIX)
    longest = len(os.fsencode(prefix)) + 12  # mkstemp's 8 letters + ".tmp"
    if longest > name_max:
        raise ConfigError(f"output {output}: the file name is too long; the run writes files named "
                          f"'{prefix}XXXXXXXX.tmp' beside it, and this folder takes names of at most "
                          f"{name_max} bytes: shorten it by {longest - name_max}")
    return target


SETTINGS_SUFFIX = ".run.json"  # <output>.run.json: the settings behind the `run` hash (results.py)


def _temp_prefix(name: str) -> str:
    return f".{name}."


class OutputLock:
    """An exclusive lock on `<target>.lock`, held until release() or until the process ends (even by kill -9:
    the kernel drops it), so two runs can never write the same output. The file holds the holder's pid.

    Only the holder writes the output's temporary files: those of a run that was killed go once the lock is
    taken, and those of a replacement that a signal cut short at release()."""

    def __init__(self, target: Path, shown: str) -> None:
        self.path = target.with_name(target.name + ".lock")
        # its and its settings file's temporary files: mkstemp's names, exactly (another output's, say of
        # `<target>.x`, start the same)
        settings = re.escape(SETTINGS_SUFFIX[1:])
        self.temps = re.compile(re.escape(_temp_prefix(target.name)) + f"({settings}\\.)?"
                                + r"[a-z0-9_]{8}\.tmp")
        self.made: list[Path] = []  # the folders this run made for the output, innermost first
        self.fd: int | None = None
        try:
            self._make_folders(target, shown)
            self.fd = self._lock(shown)
        except BaseException:  # refused: the folders made go again
            self._remove_folders()
            raise
        self._remove_temps()

    def _make_folders(self, target: Path, shown: str) -> None:
        for folder in reversed(target.parents):  # outermost first
            if os.path.lexists(folder):
                continue
            try:
                os.mkdir(folder)
            except FileExistsError:  # made by another process meanwhile: not this run's to remove
                continue
            except OSError as e:  # a read-only file system, a full disk
                raise ConfigError(
                    f"output {shown}: cannot create its folder {folder}: {e.strerror}") from None
            self.made.insert(0, folder)

    def _lock(self, shown: str) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(
                    f"output {shown}: cannot create its lock file {self.path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ConfigError(f"output {shown} is in use by another run (pid {holder})") from None
            # A run that just ended removes its lock file; if that happened after our open, we hold a lock
            # on a file nobody else can see: take the one on disk instead.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def release(self) -> None:
        """Unlock, and remove the lock file, any temporary file of the output and the folders this run made
        that are still empty.

        A signal handler calls this too, and may run inside the main thread's call (then exits):
        every step can be done twice, and the descriptor is taken before it is closed so that it is
        never closed twice."""
        if self.fd is not None:
            # while the lock file is there: once it is gone, another run may write its own
            self._remove_temps()
            try:
                # before unlocking: nobody can lock it and think they own the output
                self.path.unlink(missing_ok=True)
            except OSError:  # the folder no longer writable: a lock file left behind is harmless
                pass
            fd, self.fd = self.fd, None
            os.close(fd)
        self._remove_folders()

    def _remove_temps(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.path.parent) if self.temps.fullmatch(e.name)]
        except OSError:
            return
        for name in names:
            try:
                os.unlink(self.path.parent / name)
            except OSError:  # gone already, or the folder no longer writable
                pass

    def _remove_folders(self) -> None:
        for folder in self.made:
            try:
                folder.rmdir()
            except FileNotFoundError:  # removed already, by a release this one interrupted
                continue
            except OSError:  # it holds the results, or something else
                break
        self.made = []


Span = tuple[int, int]  # a line of a file: its offset and its length in bytes, newline not included


def rewrite_lines(target: Path, spans: list[Span], tail: bytes = b"") -> list[int]:
    """Replace `target` with its own lines at `spans`, in that order, each ending in a newline, then `tail`;
    returns where each of those lines starts in the new file. The lines are copied, never all in memory."""
    starts = []

    def write(out: BinaryIO) -> None:
        if spans:  # else there may be no file yet
            with open(target, "rb") as src:
                for offset, length in spans:
                    src.seek(offset)
                    starts.append(out.tell())
                    out.write(src.read(length) + b"\n")
        out.write(tail)
    replace_with(target, write)
    return starts


def replace_text(target: Path, text: str) -> None:
    replace_with(target, lambda out: out.write(text.encode("utf-8")))


def replace_with(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace `target` atomically with what `write` writes: a reader (or a crash) never sees half a file. The
    temporary file is private to this run and lives next to the target (os.replace needs one file system)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target.name), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _mode_for(target))
            write(f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_for(target: Path) -> int:
    """Keep an existing file's permissions; a new one gets what open() would give it (mkstemp's are 0600)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
