"""The run directory of a training run: creating, reusing or refusing it, and its metrics log.

RUN_DIR/ holds config.yaml, tokenizer/, checkpoint_{last,best,avg,stepN}.pt (checkpoint.py), metrics.jsonl
(one JSON record per evaluation), tensorboard/ (when tensorboard is installed), hyps/, results.json and
curves.png (evaluation.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import yaml

from config import Config, config_to_dict
from runtime import UserError, write_text

RUN_FILES = ("config.yaml", "checkpoint_last.pt", "checkpoint_best.pt", "metrics.jsonl", "results.json", "tokenizer")


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


def prepare_run_dir(cfg: Config, run_dir: Path, rank: int) -> bool:
    """Create the run dir; returns True when resuming. Refuses to mix two different runs in one folder."""
    t = cfg.train
    last = run_dir / "checkpoint_last.pt"
    if t.resume and t.overwrite:
        raise UserError("train.resume and train.overwrite (--resume, --overwrite) are both set: choose one, not both")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"train.out_dir {run_dir} is a file, expected a directory")
    has_run = run_dir.is_dir() and (any((run_dir / n).exists() for n in RUN_FILES)
                                    or any(run_dir.glob("checkpoint_*.pt")))
    if t.resume:
        if not last.exists():
            raise UserError(f"train.resume=true but {last} does not exist; start without train.resume")
        old = load_config_dict(run_dir / "config.yaml")
        if old is not None and old.get("model") != config_to_dict(cfg)["model"]:
            raise UserError(f"{run_dir} holds a run with another model config; resume it with its own config.yaml")
        return True
    if has_run and not t.overwrite:
        raise UserError(f"train.out_dir {run_dir} already holds a run; pass train.resume=true (--resume) to continue "
                        "it or train.overwrite=true (--overwrite) to replace it")
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create train.out_dir {run_dir}: {e.strerror or e}") from None
        if has_run:
            for p in [*run_dir.glob("checkpoint_*.pt"), *partial_files(run_dir), run_dir / "metrics.jsonl",
                      run_dir / "results.json"]:
                p.unlink(missing_ok=True)
    return False


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
