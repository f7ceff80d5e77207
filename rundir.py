"""The run directory of a training run: creating, reusing or refusing it, and its metrics log.

RUN_DIR/ holds config.yaml, tokenizer/, checkpoint_{last,best,avg,stepN}.pt (checkpoint.py), metrics.jsonl
(one JSON record per evaluation), tensorboard/ (when tensorboard is installed), hyps/, results.json and
curves.png (evaluation.py), and .lock: the run belongs to the one live process that holds its flock.

A run dir is checked twice: once read-only (check_run_dir) so that a refusal leaves every file as it was, and
again under the lock (claim_run_dir) before anything in it is deleted or written, since another process may
have changed it in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path

import yaml

from config import Config, config_to_dict
from runtime import UserError, write_text

RUN_FILES = ("config.yaml", "checkpoint_last.pt", "checkpoint_best.pt", "metrics.jsonl", "results.json", "tokenizer")
# train.resume / train.overwrite are actions of one invocation, not settings of a run: a saved config that kept
# overwrite: true would delete the finished run the next time someone ran that file.
RUN_CONTROL = ("resume", "overwrite")
LOCK_NAME = ".lock"
_held_locks: dict[Path, int] = {}  # resolved run dir -> open fd; the flock lives as long as the fd (the process)


def run_config_dict(cfg: Config) -> dict:
    """The config as a run dir and its checkpoints keep it: everything but the run-control flags."""
    d = config_to_dict(cfg)
    for key in RUN_CONTROL:
        d["train"].pop(key, None)
    return d


def save_run_config(cfg: Config, path: Path) -> None:
    """RUN/config.yaml, written atomically: a run killed meanwhile keeps a readable config for resuming."""
    write_text(path, yaml.safe_dump(run_config_dict(cfg), sort_keys=False))


def lock_run_dir(run_dir: Path) -> None:
    """Take RUN/.lock (flock, exclusive) for the rest of this process's life, or refuse naming the owner's PID.

    The kernel drops a flock when its holder exits in any way, kill -9 included, so a stale .lock file of a dead
    process never blocks anyone. Taking it again in the same process is a no-op (tests run main() twice)."""
    key = run_dir.resolve()
    if key in _held_locks:
        return
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"cannot create the lock file {path}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"train.out_dir {run_dir} is in use by another process (PID {owner}, see {path}); wait "
                        "for it to finish or stop it, or choose another train.out_dir") from None
    except OSError as e:  # a file system without flock (some NFS mounts): run unguarded rather than not at all
        print(f"warning: cannot lock {path} ({e.strerror or e}); make sure no other process uses this run dir",
              file=sys.stderr)
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[key] = fd


def partial_files(run_dir: Path) -> list[Path]:
    """Temp files of writes that a kill interrupted (atomic_write): never complete, safe to delete."""
    return [p for pattern in ("checkpoint_*.pt.tmp*", "config.yaml.tmp*", "metrics.jsonl.tmp*")
            for p in run_dir.glob(pattern)]


def load_config_dict(path: Path) -> dict | None:
    """A run's saved config.yaml as plain values; None when there is none."""
    try:
        d = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        d = []
    if d is not None and not (isinstance(d, dict) and isinstance(d.get("model", {}), dict)):
        raise UserError(f"{path} is not a readable config; pass train.overwrite=true to start over")
    return d


def has_run(run_dir: Path) -> bool:
    return run_dir.is_dir() and (any((run_dir / n).exists() for n in RUN_FILES) or any(run_dir.glob("checkpoint_*.pt")))


def check_run_dir(cfg: Config, run_dir: Path) -> bool:
    """Read-only: may this invocation use run_dir? Returns True when resuming. Refuses to mix two runs in one
    folder, and says what to do instead (a run that died before its first checkpoint can only be replaced)."""
    t = cfg.train
    last = run_dir / "checkpoint_last.pt"
    if t.resume and t.overwrite:
        raise UserError("train.resume and train.overwrite (--resume, --overwrite) are both set: choose one, not both")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"train.out_dir {run_dir} is a file, expected a directory")
    if t.resume:
        if not last.exists():
            if has_run(run_dir):
                raise UserError(f"train.resume=true but {last} does not exist: the run stopped before its first "
                                "checkpoint, so there is nothing to resume; start it over with train.overwrite=true "
                                "(--overwrite)")
            raise UserError(f"train.resume=true but {last} does not exist: there is no run to resume in "
                            f"{run_dir}; start without train.resume")
        old = load_config_dict(run_dir / "config.yaml")
        model = config_to_dict(cfg)["model"]
        defaults = config_to_dict(Config())["model"]  # a run saved before a field existed had its default
        if old is not None and {**defaults, **(old.get("model") or {})} != model:
            raise UserError(f"{run_dir} holds a run with another model config; resume it with its own config.yaml")
        return True
    if has_run(run_dir) and not t.overwrite:
        if not last.exists():
            raise UserError(f"train.out_dir {run_dir} already holds a run, one without checkpoint_last.pt (it stopped "
                            "before its first checkpoint): nothing to resume; pass train.overwrite=true "
                            "(--overwrite) to replace it")
        raise UserError(f"train.out_dir {run_dir} already holds a run; pass train.resume=true (--resume) to continue "
                        "it or train.overwrite=true (--overwrite) to replace it")
    return False


def claim_run_dir(cfg: Config, run_dir: Path, resumed_from: os.stat_result | None = None) -> None:
    """Rank 0 only: create run_dir, lock it, check it again under the lock, then clear what a replaced run left.

    resumed_from: os.stat of the checkpoint_last.pt this process has loaded; if another process rewrote it
    before the lock was ours, resuming from the copy in memory would silently lose its steps."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create train.out_dir {run_dir}: {e.strerror or e}") from None
    lock_run_dir(run_dir)
    resuming = check_run_dir(cfg, run_dir)
    last = run_dir / "checkpoint_last.pt"
    if resuming:
        now = last.stat()
        if resumed_from is None or (now.st_ino, now.st_mtime_ns, now.st_size) != (
                resumed_from.st_ino, resumed_from.st_mtime_ns, resumed_from.st_size):
            raise UserError(f"{last} was rewritten by another process while this one loaded it; start again to "
                            "resume from the new one")
        for p in partial_files(run_dir):
            p.unlink(missing_ok=True)
    elif has_run(run_dir):  # train.overwrite=true, checked above
        for p in [*run_dir.glob("checkpoint_*.pt"), *partial_files(run_dir), run_dir / "metrics.jsonl",
                  run_dir / "results.json"]:
            p.unlink(missing_ok=True)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a kill is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError, TypeError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows


class MetricsLog:
    """metrics.jsonl (one record per evaluation) and, when tensorboard is installed, its event files."""

    SCALARS = ("lr", "train_loss", "val_loss", "val_bleu", "tokens_per_s")

    def __init__(self, run_dir: Path):
        self.path, self.run_dir, self._tb = run_dir / "metrics.jsonl", run_dir, None

    def trim(self, step: int) -> None:
        """On resume keep the records up to the checkpoint's step: later ones belong to a lost future."""
        if self.path.exists():
            write_text(self.path, "".join(json.dumps(r) + "\n" for r in read_metrics(self.path) if r["step"] <= step))

    def write(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self._tb = False
        if self._tb:
            for key in self.SCALARS:
                self._tb.add_scalar(key, record[key], record["step"])

    def close(self) -> None:
        """Flush TensorBoard's event file: a torchrun process ends with os._exit, which runs no finalizer."""
        if self._tb:
            self._tb.close()
        self._tb = None
