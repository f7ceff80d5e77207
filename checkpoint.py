"""Checkpoint I/O, shared by training and translation: tensors and plain values only, written atomically.

A checkpoint is a dict {"model": state_dict, "config": plain nested dict, "step": int, "tokenizer_sha256": str}
plus, in checkpoint_last.pt, what an exact resume needs (FULL_STATE). It is read with
torch.load(weights_only=True), which cannot run code. A run directory holds config.yaml, tokenizer/ and
checkpoint_{last,best,avg,ema,stepN}.pt; it is read as checkpoint_avg.pt > _ema.pt > _best.pt > _last.pt,
since the trainer keeps an averaged model (of the last checkpoints, or the moving average of train.ema_decay)
only when it beats the best single checkpoint on validation BLEU, and then only the winner of the two.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import torch

import data_preparation as dp
from config import Config, config_from_dict
from data_preparation import tokenizer_fingerprint
from runtime import UserError, atomic_write, one_line
from transformer_model import ModelConfig, Transformer

FULL_STATE = ("optimizer", "scaler", "epoch", "batch_in_epoch", "best_bleu", "bad_evals", "skipped_steps",
              "train_seconds", "rng")  # what resuming needs beyond the weights
CHECKPOINT_ORDER = ("checkpoint_avg.pt", "checkpoint_ema.pt", "checkpoint_best.pt", "checkpoint_last.pt")  # in order
TRAINING_CHECKPOINT = re.compile(r"checkpoint_(last|best|step\d+)\.pt")  # what the trainer writes and reads back


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save through atomic_write with fsync: a kill mid-write never leaves a truncated file, and a failed
    write (disk full, permission denied, Ctrl-C) leaves the previous file and no temp file behind."""
    try:
        with atomic_write(path, "wb", durable=True) as f:
            torch.save(state, f)
    except OSError as e:
        raise UserError(f"could not write {path}: {e.strerror or e}; the previous checkpoint is intact") from None
    except RuntimeError as e:  # torch's zip writer reports a failed write (a full disk) as RuntimeError
        raise UserError(f"could not write {path}: {one_line(e, 120)}; the disk may be full; the previous "
                        "checkpoint is intact") from None


def check_average_output(path: Path) -> None:
    """--average must never replace what a run resumes or reports from: a training checkpoint (by its name, in
    any folder) or any file holding optimizer state. An existing file that is no checkpoint is not ours to
    replace either."""
    path = Path(path)
    if TRAINING_CHECKPOINT.fullmatch(path.name):
        raise UserError(f"--output {path}: refusing to overwrite a training checkpoint with averaged weights; "
                        "choose another file name (default RUN_DIR/checkpoint_avg.pt)")
    if path.is_dir():
        raise UserError(f"--output {path} is a directory, expected a file name")
    if path.exists():
        try:  # mmap: only the small pickle is read, not gigabytes of tensors
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - unreadable as a checkpoint: some other file
            state = None
        if not (isinstance(state, dict) and isinstance(state.get("model"), dict)):
            raise UserError(f"--output {path} exists and is not a checkpoint; refusing to overwrite it")
        if "optimizer" in state:
            raise UserError(f"--output {path} holds a training state (optimizer); refusing to overwrite it with "
                            "averaged weights")


def read_checkpoint(path: Path) -> dict:
    """A checkpoint file as a dict with a 'model' entry, read without executing anything from the file."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"checkpoint path is a directory, expected a checkpoint file: {path}")
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror or one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle opcode, ...: all mean the same to the user
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:  # the safe loader met a pickled Python object, which could run code: never load it
            raise UserError(f"refusing to load {path}: it holds a Python object ({refused.group(1)}) that the "
                            "safe torch.load(weights_only=True) does not accept") from None
        raise UserError(f"cannot read checkpoint {path}: truncated or corrupt ({type(e).__name__})") from None
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict)):
        raise UserError(f"{path} is not a checkpoint of this project (no 'model' entry)")
    return state


def read_resume_state(path: Path, tokenizer_sha256: str) -> dict:
    """A run's checkpoint_last.pt, checked to hold everything an exact resume needs, with the same tokenizer."""
    state = read_checkpoint(path)
    missing = [k for k in ("step", *FULL_STATE) if k not in state]
    if missing:
        raise UserError(f"{path} is not a full training checkpoint (no {', '.join(missing)}); resuming needs the "
                        "checkpoint_last.pt the trainer writes, or start over with train.overwrite=true")
    if state.get("tokenizer_sha256", tokenizer_sha256) != tokenizer_sha256:
        raise UserError(f"{path} was trained with another tokenizer than data.* now gives; resume with the "
                        "data settings of the run (its config.yaml)")
    return state


def step_checkpoints(run_dir: Path) -> list[Path]:
    """checkpoint_stepN.pt files of a run, oldest first."""
    paths = glob.glob(str(Path(run_dir) / "checkpoint_step*.pt"))
    return sorted((Path(p) for p in paths), key=lambda p: int(p.stem.removeprefix("checkpoint_step")))


def average_checkpoints(paths: list[Path]) -> dict:
    """Element-wise mean of the model weights (paper §6.1 averaged the last 5 or 20 checkpoints)."""
    if not paths:
        raise UserError("no checkpoints to average")
    total, state, sha256 = None, None, None
    for p in paths:
        state = read_checkpoint(p)
        if total is None:  # integer buffers (the output vocabulary's ids) are kept, not averaged
            total = {k: v.double().clone() if v.is_floating_point() else v for k, v in state["model"].items()}
            sha256 = state.get("tokenizer_sha256")
        elif state["model"].keys() != total.keys():
            raise UserError(f"cannot average {p}: its parameters differ from {paths[0]}")
        elif state.get("tokenizer_sha256") != sha256:
            raise UserError(f"cannot average {p}: it was trained with another tokenizer than {paths[0]}")
        else:
            for k, v in state["model"].items():
                if v.is_floating_point():
                    total[k] += v.double()
                elif not torch.equal(v, total[k]):
                    raise UserError(f"cannot average {p}: its {k} differs from {paths[0]}'s")
    model = {k: (v / len(paths)).to(state["model"][k].dtype) if v.is_floating_point() else v
             for k, v in total.items()}
    averaged = {"model": model, "config": state["config"], "step": state["step"], "averaged": [p.name for p in paths]}
    if sha256 is not None:  # translate.py checks the run's tokenizer/ against it, as for any other checkpoint
        averaged["tokenizer_sha256"] = sha256
    return averaged


def find_checkpoint(path) -> Path:
    """A .pt file as given, or in a run directory the first of checkpoint_avg.pt, _ema.pt, _best.pt, _last.pt."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint not found: {p} (give a run directory or a checkpoint .pt file)")
    if p.is_dir():
        if p.suffix == ".pt":
            raise UserError(f"checkpoint path is a directory, expected a checkpoint file: {p}")
        for name in CHECKPOINT_ORDER:
            if (p / name).exists():
                p = p / name
                break
        else:
            raise UserError(f"no checkpoint in {p}: expected one of {', '.join(CHECKPOINT_ORDER)}")
        if p.is_dir():
            raise UserError(f"checkpoint path is a directory, expected a checkpoint file: {p}")
    return p


def parameter_bytes(m: ModelConfig) -> int:
    """A lower bound of the fp32 parameter bytes of a model config, computed without building it: embeddings,
    output projection, and per layer the query/output projections of each attention and the feed-forward."""
    d = m.d_model
    embeddings = m.tgt_vocab_size * d + (0 if m.share_embeddings else m.src_vocab_size * d)
    output = 0 if (m.tie_output or m.share_embeddings) else m.tgt_vocab_size * d
    ffn = 2 * d * m.d_ff
    return 4 * (embeddings + output + m.n_enc_layers * (2 * d * d + ffn) + m.n_dec_layers * (4 * d * d + ffn))


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every system names these
        return None


def load_model(ckpt: dict, file: Path) -> tuple[Transformer, Config]:
    """The model (on the CPU, eval mode) and config that a checkpoint dict describes."""
    if not isinstance(ckpt.get("config"), dict):
        raise UserError(f"{file} is not a checkpoint of this project (no 'config' entry)")
    try:
        cfg = config_from_dict(ckpt["config"])
        need, ram = parameter_bytes(cfg.model), physical_memory()
        if ram and need > ram:  # building it would die in the allocator (or wake the OOM killer), not with a message
            raise UserError(f"its model needs at least {need / 2**30:.1f} GiB for the weights, more than the "
                            f"{ram / 2**30:.1f} GiB of memory here")
        model = Transformer(cfg.model)
    except (UserError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {file} holds an unusable config: {one_line(e)}") from None
    state = ckpt["model"]
    bad = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise UserError(f"checkpoint {file} holds non-finite weights (NaN/inf in {bad[0]}): it was saved from a "
                        "diverged run; use an earlier checkpoint")
    for prefix in ("module.", "_orig_mod."):  # DistributedDataParallel / torch.compile wrappers
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix):]: value for key, value in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, KeyError) as e:
        raise UserError(f"checkpoint {file} does not match its model config: {one_line(e)}") from None
    return model.eval(), cfg


def load_run_tokenizer(file: Path, expected_sha256: str | None) -> dp.Tokenizer:
    """The tokenizer/ folder next to a checkpoint file, checked against the fingerprint the checkpoint holds."""
    tok_dir = file.parent / "tokenizer"
    if not tok_dir.is_dir():
        raise UserError(f"tokenizer folder not found: {tok_dir} (a run directory keeps tokenizer/ next to "
                        "its checkpoints)")
    try:
        tokenizer = dp.load_tokenizer(tok_dir)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged SentencePiece model raises several types
        raise UserError(f"cannot load the tokenizer in {tok_dir}: {one_line(e)}") from None
    if expected_sha256 is not None and tokenizer_fingerprint(tok_dir) != expected_sha256:
        raise UserError(f"the tokenizer in {tok_dir} is not the one {file.name} was trained with (another run's, "
                        "or altered); copy that run's tokenizer/ folder next to the checkpoint")
    return tokenizer


def load_checkpoint(path, device: torch.device | str = "cpu") -> tuple[Transformer, dp.Tokenizer, Config]:
    """(model in eval mode on device, tokenizer, cfg) from a run directory or a checkpoint file whose folder
    holds tokenizer/."""
    file = find_checkpoint(path)
    ckpt = read_checkpoint(file)
    model, cfg = load_model(ckpt, file)
    tokenizer = load_run_tokenizer(file, ckpt.get("tokenizer_sha256"))  # absent in the oldest checkpoints
    m = cfg.model
    if (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) != (m.src_vocab_size, m.tgt_vocab_size):
        raise UserError(f"tokenizer in {tokenizer.folder} has vocab sizes {tokenizer.src_vocab_size}/"
                        f"{tokenizer.tgt_vocab_size} but the model expects {m.src_vocab_size}/"
                        f"{m.tgt_vocab_size}: it belongs to another run")
    return model.to(device), tokenizer, cfg
