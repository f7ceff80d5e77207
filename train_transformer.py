"""Train the Transformer (Vaswani et al. 2017) from a YAML config, then report test BLEU.

    python train_transformer.py --config configs/multi30k_en_de.yaml [section.key=value ...]
    torchrun --nproc_per_node=8 train_transformer.py --config configs/wmt14_en_de_base.yaml
    python train_transformer.py --average RUN_DIR --last 5          # checkpoint averaging as a command

One process per device; with torchrun the model is wrapped in DistributedDataParallel (nccl on GPU, gloo on
CPU) and every rank reads its own disjoint batches. Only rank 0 writes logs and checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import glob
import io
import json
import math
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data_preparation as dp
import translate
from config import Config, UserError, cli_main, config_from_dict, config_to_dict, load_config, save_config
from transformer_model import Transformer, count_parameters

TCMALLOC_NAMES = ["libtcmalloc_minimal.so.4", "libtcmalloc.so.4"]


def ensure_fast_allocator():
    """Re-exec once with tcmalloc preloaded: with variable batch shapes glibc malloc burns half the CPU time in the
    kernel (measured 1.56k vs 3.13k target tokens/s on a 2-core CPU). Set NMT_NO_TCMALLOC=1 to opt out."""
    if sys.platform != "linux" or os.environ.get("NMT_NO_TCMALLOC") == "1" or "tcmalloc" in os.environ.get(
        "LD_PRELOAD", ""
    ):
        return
    candidates = [f"{d}/{n}" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                                       "/usr/lib", "/usr/local/lib") for n in TCMALLOC_NAMES]
    found = next((p for p in candidates if os.path.exists(p)), None) or ctypes.util.find_library("tcmalloc_minimal")
    if not found:
        print("hint: install tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) for ~2x faster CPU "
              "training", file=sys.stderr)
        return
    os.environ["LD_PRELOAD"] = (found + " " + os.environ.get("LD_PRELOAD", "")).strip()
    os.execv(sys.executable, [sys.executable, *sys.argv])


# ----------------------------------------------------------------------------------------------------------------
# The paper's optimisation: eq. 3 schedule and label smoothing (§5.3, §5.4)


def learning_rate(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)   (paper eq. 3), times a factor."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_factor(progress: float, cooldown: float) -> float:
    """Linear decay of the lr to 0 over the last `cooldown` fraction of the run (not in the paper).

    Why: a run cut by a time budget otherwise stops at a high lr with noisy weights; annealing to zero at the end
    averages out that noise, as checkpoint averaging does at the end of the paper's far longer runs.
    progress is in [0, 1]: max of steps/max_steps and time/max_minutes (docs/multi30k_sweeps.md)."""
    if cooldown <= 0:
        return 1.0
    return max(0.0, min(1.0, (1.0 - progress) / cooldown))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy and NLL from logits (N,V), with the gradient written in closed form.

    Why not log_softmax + gather + mean under autograd: on a CPU that chain makes ~6 passes over the (N,V) logits
    forward and backward (the softmax, the mean's expanded gradient, the gather's zero-filled gradient, their sum,
    the softmax backward); here the forward is one logsumexp and the backward one exp plus in-place updates:
    d/dz [(1-eps)(lse - z_y) + eps(lse - mean z)] = softmax(z) - (1-eps) onehot(y) - eps/V."""

    @staticmethod
    def forward(ctx, logits, target, epsilon: float):
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        nll = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
        smooth = lse - logits.mean(dim=-1)  # (N,): cross-entropy against the uniform distribution
        ctx.save_for_backward(logits, target, lse)
        ctx.epsilon = epsilon
        return (1.0 - epsilon) * nll + epsilon * smooth, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, lse = ctx.saved_tensors
        eps, v = ctx.epsilon, logits.size(-1)
        g_loss = grad_loss if grad_loss is not None else torch.zeros_like(lse)  # (N,)
        g_nll = grad_nll if grad_nll is not None else torch.zeros_like(lse)  # (N,)
        grad = (logits - lse.unsqueeze(-1)).exp_()  # (N,V) softmax
        grad.mul_((g_loss + g_nll).unsqueeze(-1)).sub_((eps / v) * g_loss.unsqueeze(-1))
        grad.scatter_add_(-1, target.unsqueeze(-1), -((1.0 - eps) * g_loss + g_nll).unsqueeze(-1))
        return grad, None, None


def label_smoothed_nll(logits, target, epsilon: float, pad_id: int):
    """Sum over non-pad tokens of (1-eps)*NLL + eps*(mean NLL over the vocabulary) (Szegedy et al. 2016; paper §5.4).

    logits (B,T,V), target (B,T), or logits (N,V), target (N,) already without padding.
    Returns (smoothed loss sum, plain NLL sum): fp32 scalars (fp64 for fp64 logits)."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # autocast output: the softmax is computed in fp32
        logits = logits.float()
    logits = logits.flatten(0, -2)  # (B,T,V) -> (B*T,V); (N,V) stays
    target = target.flatten()  # (B,T) -> (B*T,)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, epsilon)  # (B*T,) or (N,) each
    pad = target.eq(pad_id)
    return loss.masked_fill(pad, 0.0).sum(), nll.masked_fill(pad, 0.0).sum()


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: plain tensors and values only, written atomically


_saves_done = 0  # atomic_save calls in this process, for the NMT_TEST_DIE_IN_SAVE test hook


def atomic_save(obj, path: Path):
    """torch.save to a temp file, fsync, then os.replace: a kill mid-write never leaves a truncated file, and a
    failed write (disk full, permission denied, Ctrl-C) leaves the previous file and no temp file behind.

    Test hook: NMT_TEST_DIE_IN_SAVE=N makes the N-th save of the process write half its bytes and then SIGKILL
    the process, the worst moment for a power cut (tests/test_robustness.py)."""
    global _saves_done
    _saves_done += 1
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if os.environ.get("NMT_TEST_DIE_IN_SAVE") == str(_saves_done):
                buf = io.BytesIO()
                torch.save(obj, buf)
                f.write(buf.getvalue()[: buf.tell() // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(f"could not write {path}: {e.strerror or e}; the previous checkpoint is intact") from None
    except BaseException:  # Ctrl-C, SystemExit from a signal handler: the old file stays, the half file goes
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (best effort: not every FS allows it)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


FULL_STATE = ("optimizer", "scaler", "epoch", "batch_in_epoch", "best_bleu", "bad_evals", "skipped_steps",
              "train_seconds", "rng")  # what resuming needs beyond the weights


def load_state(path: Path) -> dict:
    """Read a checkpoint written by atomic_save without executing anything from the file."""
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a directory, expected a checkpoint file")
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle opcode, ...: all mean the same to the user
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:  # the safe loader met a pickled Python object, which could run code: never load it
            raise UserError(f"refusing to load {path}: it holds a Python object ({refused.group(1)}) that the "
                            "safe torch.load(weights_only=True) does not accept") from None
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}): truncated or corrupt") from None
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict)):
        raise UserError(f"{path} is not a checkpoint of this project (no 'model' entry)")
    return state


def average_checkpoints(paths: list[Path]) -> dict:
    """Element-wise mean of the model weights (paper §6.1 averaged the last 5 or 20 checkpoints)."""
    if not paths:
        raise UserError("no checkpoints to average")
    total, state = None, None
    for p in paths:
        state = load_state(p)
        if total is None:
            total = {k: v.double().clone() for k, v in state["model"].items()}
        elif state["model"].keys() != total.keys():
            raise UserError(f"cannot average {p}: its parameters differ from {paths[0]}")
        else:
            for k, v in state["model"].items():
                total[k] += v.double()
    model = {k: (v / len(paths)).to(state["model"][k].dtype) for k, v in total.items()}
    return {"model": model, "config": state["config"], "step": state["step"], "averaged": [p.name for p in paths]}


def step_checkpoints(run_dir: Path) -> list[Path]:
    paths = glob.glob(str(run_dir / "checkpoint_step*.pt"))
    return sorted((Path(p) for p in paths), key=lambda p: int(p.stem.removeprefix("checkpoint_step")))


# ----------------------------------------------------------------------------------------------------------------
# Devices, precision, distributed set-up


def setup_distributed(device_name: str):
    """(rank, world_size, device) from torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("train.device asks for CUDA but no GPU is visible; use train.device=cpu")
        device = torch.device("cuda", local if world > 1 else torch.device(device_name).index or 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto': bf16 where the hardware computes it natively (recent GPUs; CPUs with AMX or AVX512-BF16), else
    fp32. Without native support bf16 is emulated and far slower than fp32 (measured ~7x on an AVX2-only EPYC)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bf16" if ("amx_bf16" in flags or "avx512_bf16" in flags) else "fp32"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
             "numpy_pos": int(np.random.get_state()[2]), "python": repr(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    random.setstate(_literal(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _literal(text: str):
    import ast

    return ast.literal_eval(text)


# ----------------------------------------------------------------------------------------------------------------
# Run directory


RUN_FILES = ("config.yaml", "checkpoint_last.pt", "checkpoint_best.pt", "metrics.jsonl", "results.json", "tokenizer")


def partial_files(run_dir: Path) -> list[Path]:
    """Temp files of writes that a kill interrupted (atomic_save, save_config): never complete, safe to delete."""
    return [p for pattern in ("checkpoint_*.pt.tmp*", "config.yaml.tmp*") for p in run_dir.glob(pattern)]


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


def load_config_dict(path: Path):
    import yaml

    try:
        d = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        d = []
    if d is not None and not (isinstance(d, dict) and isinstance(d.get("model", {}), dict)):
        raise UserError(f"{path} is not a readable config; pass train.overwrite=true to start over")
    return d


def trim_metrics(path: Path, step: int):
    """On resume keep the metrics.jsonl records up to the checkpoint's step: later ones belong to a lost future,
    and a line cut by a kill is dropped."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            if json.loads(line)["step"] <= step:
                keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep), encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# Training


class Trainer:
    """Owns the model, optimizer and data order, so that everything needed for an exact resume is in one place."""

    def __init__(self, cfg: Config, rank: int, world: int, device: torch.device):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.run_dir = Path(cfg.train.out_dir)
        self.master = rank == 0
        t = cfg.train
        # One process per machine prepares the data (machines need not share a disk); the others then find it.
        first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
        if world > 1 and not first_on_node:
            dist.barrier()
        self.prepared = dp.prepare(cfg.data)
        if world > 1 and first_on_node:
            dist.barrier()
        self.tokenizer = dp.load_tokenizer(self.prepared)
        cfg.model.src_vocab_size = self.tokenizer.src_vocab_size
        cfg.model.tgt_vocab_size = self.tokenizer.tgt_vocab_size
        cfg.model.pad_id = self.tokenizer.pad_id
        if cfg.model.share_embeddings and not self.tokenizer.joint:
            raise UserError("model.share_embeddings=true needs one joint vocabulary (data.tokenizer=bpe); "
                            "set model.share_embeddings=false")
        self.tokenizer_sha256 = translate.tokenizer_fingerprint(self.prepared)
        self.train_split = dp.load_split(self.prepared, "train")
        self.valid_split = dp.load_split(self.prepared, cfg.data.valid_split)
        if len(self.train_split) == 0:  # else the batch stream would loop over empty epochs forever
            raise UserError(f"no training pairs left in {self.prepared} after dropping blank lines and the "
                            f"data.max_len={cfg.data.max_len} / data.max_len_ratio={cfg.data.max_len_ratio} filter; "
                            "check the training files or raise data.max_len")
        if len(self.valid_split) == 0:  # else found by the first evaluation, after hours of training
            raise UserError(f"the validation split '{cfg.data.valid_split}' is empty; give validation files with "
                            "at least one sentence pair")
        self.resuming = prepare_run_dir(cfg, self.run_dir, rank)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        np.random.seed(t.seed)
        self.model = Transformer(cfg.model).to(device)
        self.sampler = dp.TokenBatchSampler(self.train_split.src_lengths, self.train_split.tgt_lengths, t.max_tokens,
                                            shuffle=True, seed=t.seed, rank=rank, world_size=world,
                                            pad_multiple=t.pad_multiple)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(t.adam_beta1, t.adam_beta2),
                                          eps=t.adam_eps, weight_decay=t.weight_decay)
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.best_bleu, self.bad_evals, self.bad_steps, self.skipped_steps = -1.0, 0, 0, 0
        self.train_seconds = 0.0
        self.stop_signal, self.in_loop = None, False
        self.last_saved_step = None  # step of the checkpoint_last.pt on disk, for the messages
        if self.resuming:
            self.load_last()
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[device.index] if device.type
                                                              == "cuda" else None) if world > 1 else self.model)
        self.forward = torch.compile(self.ddp) if t.compile else self.ddp
        if self.master:
            save_config(cfg, self.run_dir / "config.yaml")
            self.tokenizer.save(self.run_dir / "tokenizer")

    # -- state -------------------------------------------------------------------------------------------------

    def state(self, full: bool) -> dict:
        state = {"model": self.model.state_dict(), "config": config_to_dict(self.cfg), "step": self.step,
                 "tokenizer_sha256": self.tokenizer_sha256}
        if full:
            state.update(optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict(), epoch=self.epoch,
                         batch_in_epoch=self.batch_in_epoch, best_bleu=self.best_bleu, bad_evals=self.bad_evals,
                         skipped_steps=self.skipped_steps, train_seconds=self.train_seconds, rng=rng_state())
        return state

    def load_last(self):
        path = self.run_dir / "checkpoint_last.pt"
        state = load_state(path)
        missing = [k for k in ("step", *FULL_STATE) if k not in state]
        if missing:
            raise UserError(f"{path} is not a full training checkpoint (no {', '.join(missing)}); resuming needs the "
                            "checkpoint_last.pt the trainer writes, or start over with train.overwrite=true")
        if state.get("tokenizer_sha256", self.tokenizer_sha256) != self.tokenizer_sha256:
            raise UserError(f"{path} was trained with another tokenizer than data.* now gives; resume with the "
                            "data settings of the run (its config.yaml)")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise UserError(f"checkpoint_last.pt does not match this model config: {translate.one_line(e)}") from None
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.best_bleu, self.bad_evals = state["best_bleu"], state["bad_evals"]
        self.skipped_steps, self.train_seconds = state["skipped_steps"], state["train_seconds"]
        self.last_saved_step = self.step
        if self.master:
            for p in partial_files(self.run_dir):
                p.unlink(missing_ok=True)
            trim_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.log(f"resumed from step {self.step} (epoch {self.epoch + 1}, batch {self.batch_in_epoch})")

    def save(self, name: str, full: bool = False):
        if not self.master:
            return
        if not all(bool(p.isfinite().all()) for p in self.model.parameters()):  # never replace a good file
            raise UserError(f"training diverged: the weights hold NaN/inf at step {self.step}, not writing {name}; "
                            f"{self.last_good()}")
        atomic_save(self.state(full), self.run_dir / name)
        if name == "checkpoint_last.pt":
            self.last_saved_step = self.step

    def last_good(self) -> str:
        if self.last_saved_step is None:
            return "no checkpoint_last.pt was written yet"
        return f"checkpoint_last.pt (step {self.last_saved_step}) is the last good one, resume from it"

    def log(self, message: str):
        if self.master:
            tqdm.write(message, file=sys.stderr)

    # -- data --------------------------------------------------------------------------------------------------

    def batches(self):
        """Endless stream of (src, tgt_in, tgt_out), continuing from the saved position in the epoch."""
        while True:
            self.sampler.set_epoch(self.epoch)
            order = list(self.sampler)
            while self.batch_in_epoch < len(order):
                indices = order[self.batch_in_epoch]
                self.batch_in_epoch += 1
                batch = dp.collate(self.train_split, indices, self.tokenizer.pad_id, self.cfg.train.pad_multiple)
                yield [x.to(self.device, non_blocking=True) for x in batch]
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            if self.cfg.train.max_epochs and self.epoch >= self.cfg.train.max_epochs:
                return

    # -- one update --------------------------------------------------------------------------------------------

    def progress(self) -> float:
        """Fraction of the run done, by steps or by training time, whichever is further (for train.cooldown)."""
        t = self.cfg.train
        done = self.step / t.max_steps
        if t.max_minutes:
            done = max(done, self.train_seconds / (60 * t.max_minutes))
        return min(done, 1.0)

    def train_step(self, group) -> tuple[float, int]:
        """One optimizer update over update_freq batches; gradients are normalised by the update's target tokens
        summed over all ranks, so N ranks equal one process with update_freq * N."""
        t, pad = self.cfg.train, self.tokenizer.pad_id
        lr = learning_rate(self.step + 1, self.cfg.model.d_model, t.warmup, t.lr_factor)
        lr *= cooldown_factor(self.progress(), t.cooldown)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        ntok = torch.tensor(float(sum(int(tgt_out.ne(pad).sum()) for _, _, tgt_out in group)), device=self.device)
        if self.world > 1:
            dist.all_reduce(ntok)
        ntok = float(ntok)
        self.optimizer.zero_grad(set_to_none=True)
        nll_total = 0.0
        for i, (src, tgt_in, tgt_out) in enumerate(group):
            sync = i == len(group) - 1 or self.world == 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with translate.autocast(self.device, t.precision):
                    keep = tgt_out.ne(pad)  # (B,T) real target tokens
                    logits = self.forward(src, tgt_in, keep=keep)  # (N,V)
                loss, nll = label_smoothed_nll(logits, tgt_out[keep], t.label_smoothing, pad)
                self.scaler.scale(loss * self.world / ntok).backward()
            nll_total += float(nll.detach())
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_norm if t.clip_norm > 0 else math.inf)
        loss_ok = torch.tensor(float(math.isfinite(nll_total)), device=self.device)
        if self.world > 1:  # every rank must take the same decision
            dist.all_reduce(loss_ok, op=dist.ReduceOp.MIN)
        loss_ok = bool(loss_ok)
        grads_ok = bool(torch.isfinite(norm))  # the norm of the all-reduced gradients: the same on every rank
        if self.scaler.is_enabled():  # fp16: GradScaler skips an update whose gradients overflowed
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if loss_ok and not grads_ok:  # normal while the loss scale settles: logged, not counted as divergence
                self.log(f"step {self.step + 1}: fp16 gradient overflow, GradScaler skipped the update and lowered "
                         f"the loss scale from {scale:g} to {self.scaler.get_scale():g}")
                return float("nan"), 0
        elif loss_ok and grads_ok:
            self.optimizer.step()
        if not (loss_ok and grads_ok):  # NaN/inf loss: skip the update, and stop if it keeps happening
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            self.skipped_steps += 1
            self.log(f"step {self.step + 1}: non-finite {'gradient' if loss_ok else 'loss'}, update skipped "
                     f"({self.bad_steps} in a row, {self.skipped_steps} in all)")
            if self.bad_steps >= t.max_bad_steps:
                raise UserError(f"training diverged: {self.bad_steps} non-finite updates in a row after step "
                                f"{self.step}; lower train.lr_factor or set train.clip_norm; {self.last_good()}")
            return float("nan"), 0
        self.bad_steps = 0
        self.step += 1
        return nll_total / max(ntok / self.world, 1.0), int(ntok)

    # -- evaluation --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def valid_loss(self) -> float:
        self.model.eval()
        sampler = dp.TokenBatchSampler(self.valid_split.src_lengths, self.valid_split.tgt_lengths,
                                       self.cfg.train.max_tokens, shuffle=False, seed=0,
                                       pad_multiple=self.cfg.train.pad_multiple)
        total, count = 0.0, 0
        for indices in sampler:
            batch = dp.collate(self.valid_split, indices, self.tokenizer.pad_id, self.cfg.train.pad_multiple)
            src, tgt_in, tgt_out = (x.to(self.device) for x in batch)
            keep = tgt_out.ne(self.tokenizer.pad_id)  # (B,T) real target tokens
            with translate.autocast(self.device, self.cfg.train.precision):
                logits = self.model(src, tgt_in, keep=keep)  # (N,V)
            total += float(label_smoothed_nll(logits, tgt_out[keep], 0.0, self.tokenizer.pad_id)[1])
            count += int(keep.sum())
        self.model.train()
        return total / max(count, 1)

    def bleu_on(self, split: str, beam: int, limit: int = 0) -> tuple[dict, list[str]]:
        d = self.cfg.data
        sources = dp.read_raw(self.prepared, split, d.src_lang)
        refs = dp.read_raw(self.prepared, split, d.tgt_lang)
        if limit:
            sources, refs = sources[:limit], refs[:limit]
        self.model.eval()
        dec = self.cfg.decode
        hyps = translate.translate_texts(self.model, self.tokenizer, sources, beam=beam,
                                         len_penalty=dec.len_penalty, max_len_a=dec.max_len_a,
                                         max_len_b=dec.max_len_b, batch_tokens=dec.batch_tokens,
                                         device=self.device, precision=self.cfg.train.precision,
                                         progress=self.master and beam > 1)
        self.model.train()
        return translate.score(hyps, refs, d.tgt_lang), hyps

    def evaluate(self, train_loss: float, tokens_per_s: float) -> bool:
        """Validation loss, greedy val BLEU, checkpoints; returns True when early stopping says stop."""
        stop = False
        if self.master:
            vloss = self.valid_loss()
            scores, _ = self.bleu_on(self.cfg.data.valid_split, beam=1, limit=self.cfg.train.eval_bleu_sentences)
            bleu = scores["bleu"]
            improved = bleu > self.best_bleu
            if improved:
                self.best_bleu, self.bad_evals = bleu, 0
                self.save("checkpoint_best.pt")
            else:
                self.bad_evals += 1
            self.save(f"checkpoint_step{self.step}.pt")
            for old in step_checkpoints(self.run_dir)[: -self.cfg.train.keep_last]:
                old.unlink(missing_ok=True)
            self.save("checkpoint_last.pt", full=True)
            record = {"step": self.step, "epoch": self.epoch + 1, "lr": self.optimizer.param_groups[0]["lr"],
                      "train_loss": train_loss, "val_loss": vloss, "val_ppl": math.exp(min(vloss, 50)),
                      "val_bleu": bleu, "tokens_per_s": tokens_per_s, "elapsed_s": self.train_seconds}
            with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            self.tb_log(record)
            self.log(f"step {self.step} | val loss {vloss:.3f} ppl {record['val_ppl']:.2f} | val BLEU {bleu:.2f}"
                     f"{' (best)' if improved else ''} | {tokens_per_s:.0f} tok/s")
            patience = self.cfg.train.patience
            stop = bool(patience and self.bad_evals >= patience)
        if self.world > 1:
            flag = torch.tensor([int(stop)], device=self.device)
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        return stop

    def tb_log(self, record: dict):
        if not hasattr(self, "_tb"):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self._tb = None
        if self._tb is not None:
            for key in ("lr", "train_loss", "val_loss", "val_bleu", "tokens_per_s"):
                self._tb.add_scalar(key, record[key], record["step"])

    # -- the loop ----------------------------------------------------------------------------------------------

    def train(self):
        t = self.cfg.train
        self.install_signal_handlers()
        self.model.train()
        stream = self.batches()
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.master, desc="train", unit="step",
                   dynamic_ncols=True, file=sys.stderr)
        loss_avg, t0 = None, time.perf_counter()
        window_tokens, window_start, tok_s = 0, self.train_seconds, 0.0
        self.in_loop = True
        try:
            while self.step < t.max_steps:
                group = [b for _, b in zip(range(t.update_freq), stream, strict=False)]
                if not group:
                    self.log(f"reached train.max_epochs={t.max_epochs}")
                    break
                before = self.step
                loss, ntok = self.train_step(group)
                now = time.perf_counter()
                self.train_seconds += now - t0
                t0 = now
                if self.world > 1:  # one clock for all ranks: the same cooldown lr and the same stopping step
                    clock = torch.tensor(self.train_seconds, dtype=torch.float64, device=self.device)
                    dist.broadcast(clock, src=0)
                    self.train_seconds = float(clock)
                window_tokens += ntok
                out_of_time = t.max_minutes and self.train_seconds >= 60 * t.max_minutes
                if self.step > before:  # a skipped (non-finite) update is no step: no log, eval or save for it
                    if math.isfinite(loss):
                        loss_avg = loss if loss_avg is None else 0.98 * loss_avg + 0.02 * loss
                    bar.update(1)
                    if self.step % t.log_every == 0 or self.step == 1:
                        tok_s = window_tokens / max(self.train_seconds - window_start, 1e-9)
                        window_tokens, window_start = 0, self.train_seconds
                        bar.set_postfix(loss=f"{loss_avg or float('nan'):.3f}", tok_s=f"{tok_s:.0f}",
                                        lr=f"{self.optimizer.param_groups[0]['lr']:.2e}", epoch=self.epoch + 1)
                    if self.step % t.eval_every == 0 or self.step >= t.max_steps or out_of_time:
                        if self.evaluate(loss_avg if loss_avg is not None else float("nan"), tok_s):
                            self.log(f"early stopping: no better val BLEU in {t.patience} evaluations")
                            break
                        t0 = time.perf_counter()  # evaluation time is not training time
                    elif t.save_every and self.step % t.save_every == 0:
                        self.save("checkpoint_last.pt", full=True)
                if out_of_time:
                    self.log(f"reached train.max_minutes={t.max_minutes:g}")
                    break
                if self.stop_signal is not None:
                    self.save("checkpoint_last.pt", full=True)
                    self.log(f"{signal.Signals(self.stop_signal).name} received: saved checkpoint_last.pt at step "
                             f"{self.step}; continue with train.resume=true (--resume)")
                    raise SystemExit(128 + self.stop_signal)
            self.save("checkpoint_last.pt", full=True)
        finally:
            self.in_loop = False
            bar.close()  # before any message, so that an error starts its own line

    def install_signal_handlers(self):
        """SIGINT/SIGTERM in the loop: finish the step, save checkpoint_last.pt, exit 128 + signal number.
        A second signal, or one outside the loop (checkpoint_last.pt is complete then), exits at once."""
        def handler(signum, _frame):
            name = signal.Signals(signum).name
            if self.stop_signal is not None or not self.in_loop:
                self.log(f"{name}: stopping now; {self.last_good()}")
                raise SystemExit(128 + signum)
            self.stop_signal = signum
            self.log(f"{name}: finishing the current step, then saving")

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # -- final report ------------------------------------------------------------------------------------------

    def final_report(self) -> dict:
        """Pick best vs. averaged weights on val BLEU, then beam-search every test split (paper §6.1)."""
        if not self.master:
            return {}
        t, d, dec = self.cfg.train, self.cfg.data, self.cfg.decode
        candidates = {}
        if (self.run_dir / "checkpoint_best.pt").exists():
            candidates["best"] = self.run_dir / "checkpoint_best.pt"
        recent = step_checkpoints(self.run_dir)[-t.average_last:] if t.average_last > 1 else []
        if len(recent) > 1:
            atomic_save(average_checkpoints(recent), self.run_dir / "checkpoint_avg.pt")
            candidates[f"avg{len(recent)}"] = self.run_dir / "checkpoint_avg.pt"
        val = {}
        for name, path in candidates.items():
            self.model.load_state_dict(load_state(path)["model"])
            val[name] = self.bleu_on(d.valid_split, beam=1)[0]["bleu"]
        chosen = max(val, key=val.get) if val else "last"
        if chosen != "last":
            self.model.load_state_dict(load_state(candidates[chosen])["model"])
        if chosen == "best" and (self.run_dir / "checkpoint_avg.pt").exists():
            (self.run_dir / "checkpoint_avg.pt").unlink()  # translate.py prefers checkpoint_avg.pt: keep only a winner
        self.log(f"validation BLEU (greedy): {json.dumps(val)} -> testing '{chosen}' with beam {dec.beam}")
        results = {"model": chosen, "step": self.step, "val_bleu_greedy": val, "train_minutes": self.train_seconds / 60,
                   "parameters": count_parameters(self.model), "device": str(self.device), "tests": {}}
        (self.run_dir / "hyps").mkdir(exist_ok=True)
        for split in [d.valid_split, *dp.load_meta(self.prepared)["test_splits"]]:
            scores, hyps = self.bleu_on(split, beam=dec.beam)
            (self.run_dir / "hyps" / f"{split}.{d.tgt_lang}").write_text(
                "".join(translate.clean(h) + "\n" for h in hyps), encoding="utf-8")  # one line per input line
            results["tests"][split] = scores
        (self.run_dir / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(f"\n{d.src_lang}->{d.tgt_lang}, {chosen} weights, step {self.step}, "
              f"{self.train_seconds / 60:.1f} min of training, beam {dec.beam}, len_penalty {dec.len_penalty}")
        print(f"{'split':<20} {'BLEU':>6} {'chrF':>6} {'tok.lc BLEU':>12}")
        for split, s in results["tests"].items():
            print(f"{split:<20} {s['bleu']:6.2f} {s['chrf']:6.2f} {s['bleu_tok_lc']:12.2f}")
        print(f"sacreBLEU signature: {next(iter(results['tests'].values()))['signature']}")
        print(f"results: {self.run_dir / 'results.json'}")
        plot_curves(self.run_dir)
        return results


def plot_curves(run_dir: Path):
    """Training curves from metrics.jsonl, written to curves.png."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a kill
            rows.append(json.loads(line))
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(steps, [r["train_loss"] for r in rows], label="train (smoothed NLL)")
    axes[0].plot(steps, [r["val_loss"] for r in rows], label="validation NLL")
    axes[0].set_ylabel("loss (nats/token)")
    axes[0].legend()
    axes[1].plot(steps, [r["val_bleu"] for r in rows], marker="o")
    axes[1].set_ylabel("validation BLEU (greedy)")
    axes[2].plot(steps, [r["lr"] for r in rows])
    axes[2].set_ylabel("learning rate")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Train an encoder-decoder Transformer from a YAML config, then report test BLEU.",
        epilog="Overrides: trailing section.key=value pairs, e.g. train.max_steps=2000 data.vocab_size=10000. "
        "Multi-GPU: torchrun --nproc_per_node=N train_transformer.py --config ...",
    )
    p.add_argument("--config", help="YAML config (see configs/)")
    p.add_argument("--average", metavar="RUN_DIR", help="average the last --last step checkpoints of RUN_DIR and exit")
    p.add_argument("--last", type=int, default=5, help="with --average: how many checkpoints (default 5)")
    p.add_argument("--output", help="with --average: output file (default RUN_DIR/checkpoint_avg.pt)")
    p.add_argument("--resume", action="store_true", help="continue the run in train.out_dir (= train.resume=true)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in train.out_dir (= train.overwrite=true)")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for user errors")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args(argv)
    if not args.config and not args.average:
        p.error("--config is required (or --average RUN_DIR)")
    args.overrides += ["train.resume=true"] * args.resume + ["train.overwrite=true"] * args.overwrite
    return args


def main(argv):
    args = parse_args(argv)
    if args.average:
        run_dir = Path(args.average)
        if args.last < 1:
            raise UserError("--last must be >= 1")
        paths = step_checkpoints(run_dir)[-args.last:]
        if not paths:
            raise UserError(f"no checkpoint_step*.pt files in {run_dir}")
        out = Path(args.output) if args.output else run_dir / "checkpoint_avg.pt"
        atomic_save(average_checkpoints(paths), out)
        print(f"averaged {', '.join(p.name for p in paths)} -> {out}")
        return
    cfg = load_config(args.config, args.overrides)
    ensure_fast_allocator()
    rank, world, device = setup_distributed(cfg.train.device)
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    try:
        trainer = Trainer(cfg, rank, world, device)
        if trainer.master:
            trainer.log(f"model: {count_parameters(trainer.model) / 1e6:.2f} M parameters, {cfg.model.attention}, "
                        f"{cfg.model.n_enc_layers}+{cfg.model.n_dec_layers} layers, d_model {cfg.model.d_model} | "
                        f"train pairs {len(trainer.train_split)} | {world} process(es) on {device} | "
                        f"{cfg.train.precision} | run dir {trainer.run_dir}")
        trainer.train()
        trainer.final_report()
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["Config", "config_from_dict", "learning_rate", "cooldown_factor", "label_smoothed_nll",
           "average_checkpoints", "Trainer"]

if __name__ == "__main__":
    cli_main(main)
