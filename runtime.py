"""Runtime policies shared by training, translation and the benchmark, each written once.

- UserError and cli_main: a mistake the user can fix is one line on stderr and exit status 2, never a traceback.
- resolve_device: which torch device a device string means here, with one clear error if it cannot be used.
- cpu_info / native_bf16 / resolve_precision / autocast: what the CPU is; bf16 only where the hardware computes it
  natively.
- atomic_write: a file appears complete or not at all (temp file in the same folder, then rename); a symlink's
  target is written, a device or FIFO in place; errors name the file, not the temp file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file...): reported as one line, without a traceback.

    quiet: another process of the same torchrun job (rank 0) reports this error, so this one only exits."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception message squeezed onto one line (state-dict errors span many)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


QUIET_RANK_WAIT_S = 60  # how long a quiet rank waits for rank 0 to report the error and torchrun to stop it


def cli_main(main: Callable[[list[str]], object], argv: list[str] | None = None) -> object:
    """Run ``main(argv)``; a UserError becomes ``error: ...`` on stderr and exit status 2 (under torchrun a rank
    other than 0 says ``error (rank N): ...``, or nothing when rank 0 reports the same error).

    ``--debug`` (declared by each script's parser) or NMT_DEBUG=1 also prints the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("NMT_DEBUG") == "1"
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: which process this is
    try:
        return main(argv)
    except UserError as e:
        if debug:
            traceback.print_exc()
        if e.quiet:
            # Rank 0 says it and exits; torchrun then stops this process. Leaving first let torchrun stop rank 0
            # before it could say it (seen in CI) and name this silent rank as the failure's cause.
            time.sleep(QUIET_RANK_WAIT_S)
        print(f"error{f' (rank {rank})' * (rank > 0)}: {e}", file=sys.stderr)  # quiet: rank 0 did not end the job
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # disk full, permission denied, a file where a folder should be: the machine, not a bug
        if debug:
            traceback.print_exc()
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------- device and precision


def resolve_device(name: str, what: str = "device") -> torch.device:
    """'auto' (CUDA when visible, else CPU), 'cpu', 'cuda' or 'cuda:N' -> a usable torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if re.fullmatch(r"cpu|cuda(:\d+)?", name) is None:
        raise UserError(f"{what} '{name}' is not a device; use auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{what} asks for CUDA but no GPU is visible; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{what} '{name}': only {torch.cuda.device_count()} GPU(s) are visible")
    return device


@functools.cache
def cpu_info(field: str) -> str:
    """The first value of a /proc/cpuinfo field ("model name", "vendor_id", "flags"); '' where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines
                 if ":" in line and line.split(":", 1)[0].strip() == field), "")


def native_bf16(device: torch.device) -> bool:
    """True where bf16 matmuls run natively: recent GPUs, CPUs with AMX or AVX512-BF16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_info("flags").split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto': bf16 where native, else fp32 on CPU and fp16 on older GPUs. Without native support bf16 is
    emulated and far slower than fp32 (measured ~7x on an AVX2-only EPYC)."""
    if precision != "auto":
        return precision
    if native_bf16(device):
        return "bf16"
    return "fp16" if device.type == "cuda" else "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast around a forward pass; fp32 runs as is."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise UserError(f"precision '{precision}' is unknown; use fp32, bf16 or fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---------------------------------------------------------------- files


def temp_path(path: Path) -> Path:
    """The sibling name a write goes to before its rename: NAME.tmp<random>, unique across processes and hosts."""
    return path.with_name(f"{path.name}.tmp{uuid.uuid4().hex[:8]}")


def fsync_dir(folder: Path) -> None:
    """Make a rename in folder durable (best effort: not every file system allows opening a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_target(path: Path) -> tuple[Path, bool]:
    """(the file a write to path really writes, whether it may be replaced by a renamed temp file).

    A symlink is followed, so its target gets the text and the link stays a link (a temp file renamed onto the
    link would replace the link, and next to the link it may sit on another disk than the target). Only a
    regular file or a new path is replaced: renaming onto a device, FIFO or socket would swap the node itself
    for a regular file (as root, /dev/null!) and a FIFO's reader would wait forever; those are written in place."""
    try:
        mode = path.stat().st_mode  # follows symlinks
    except FileNotFoundError:  # a new file, or a dangling symlink: created at the link's target
        return Path(os.path.realpath(path)), True
    except OSError:  # a symlink loop, a component that is not a folder: opening the path reports it
        return path, True
    if not stat.S_ISREG(mode):
        # opened through the link itself: /dev/stdout's target, /proc/self/fd/1 -> 'pipe:[123]', has no usable name
        return path, False
    return Path(os.path.realpath(path)), True


def _name_the_file(e: OSError, path: Path, tmp: Path) -> OSError:
    """The error of a write to tmp, told about path: the user knows the output file, not our temp name. An
    error without a file name (a write or flush failing: disk full, quota, I/O error) is about the file too."""
    if e.filename not in (None, str(tmp)):
        return e
    return OSError(e.errno, e.strerror or str(e), str(path))  # OSError(errno, ...) picks the subclass


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", durable: bool = False, **open_args) -> Iterator[IO]:
    """Open a temp file next to path; on success rename it onto path, on any failure (an exception, Ctrl-C, a
    signal turned into SystemExit) delete it. Readers see the old file or the new one, never half of one.

    A symlink is followed and its target written the same way; a device, FIFO or socket is opened and written
    in place (see write_target). An OSError names path, never the temp file.
    durable: fsync the file and the rename (checkpoints: a power cut must not leave a truncated file)."""
    path = Path(path)
    if "b" not in mode:
        open_args.setdefault("encoding", "utf-8")
    target, replace = write_target(path)
    if not replace:
        try:
            with open(target, mode, **open_args) as f:
                yield f
        except OSError as e:
            named = _name_the_file(e, path, target)
            if named is e:
                raise
            raise named from e
        return
    tmp = temp_path(target)
    try:
        with open(tmp, mode, **open_args) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        named = _name_the_file(e, path, tmp) if isinstance(e, OSError) else e
        if named is e:
            raise
        raise named from e
    if durable:
        fsync_dir(target.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically replace path's content with text (UTF-8, \\n line ends)."""
    with atomic_write(path, "w", newline="\n") as f:
        f.write(text)
