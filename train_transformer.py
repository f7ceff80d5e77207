"""Train the Transformer (Vaswani et al. 2017) from a YAML config, then report test BLEU.

    python train_transformer.py --config configs/multi30k_en_de.yaml [section.key=value ...]
    torchrun --nproc_per_node=8 train_transformer.py --config configs/wmt14_en_de_base.yaml
    python train_transformer.py --average RUN_DIR --last 5          # checkpoint averaging as a command
    python train_transformer.py --report RUN_DIR                    # the final report of a finished run, again

main() builds the pieces (build_trainer: data, tokenizer, model, optimizer, sampler, DDP) and hands them to
Trainer, which owns the training state and its contract: one update, evaluation, checkpoints, exact resume.
The final report of a finished run is evaluation.final_report; --report RUN_DIR (or --resume of a run that
reached train.max_steps) writes it again from the checkpoints without training. One process per device; with
torchrun the model is wrapped in DistributedDataParallel (nccl on GPU, gloo on CPU) and every rank reads its own
disjoint batches. Only rank 0 writes logs and checkpoints.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import ctypes.util
import math
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

import data_preparation as dp
from checkpoint import (
    average_checkpoints,
    check_average_output,
    find_checkpoint,
    load_checkpoint,
    read_resume_state,
    save_checkpoint,
    step_checkpoints,
)
from config import (
    FINETUNE_FREE_MODEL_FIELDS,
    Config,
    TrainConfig,
    finetune_mismatches,
    load_config,
    read_yaml,
    validate,
)
from evaluation import bleu_on, final_report, selection_bleu, valid_loss
from loss import TranslationLoss
from rundir import (
    RUN_CONTROL,
    MetricsLog,
    check_run_dir,
    claim_run_dir,
    load_config_dict,
    lock_run_dir,
    run_config_dict,
    save_run_config,
)
from runtime import UserError, autocast, cli_main, one_line, resolve_device, resolve_precision
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
# The paper's optimisation: eq. 3 schedule (§5.3); the loss (§5.4) is loss.py


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


# ----------------------------------------------------------------------------------------------------------------
# Processes and random state


def setup_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, "train.device")
    if device.type == "cuda":
        device = torch.device("cuda", local if world > 1 else device.index or 0)
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def rng_state() -> dict:
    """Every random generator's state as tensors and plain values (weights_only-loadable)."""
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
             "numpy_pos": int(np.random.get_state()[2]), "python": repr(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    random.setstate(ast.literal_eval(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def run_progress(step: int, train_seconds: float, t) -> float:
    """Fraction of the run done, by steps or by training time, whichever is further (for train.cooldown)."""
    done = step / t.max_steps
    if t.max_minutes:
        done = max(done, train_seconds / (60 * t.max_minutes))
    return min(done, 1.0)


class Meter:
    """The progress bar, a moving average of the training loss and target tokens/s over the last log window."""

    def __init__(self, max_steps: int, step: int, train_seconds: float, show: bool):
        self.bar = tqdm(total=max_steps, initial=step, disable=not show, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr)
        self.avg: float | None = None
        self.tokens, self.window_start, self.tok_s = 0, train_seconds, 0.0

    @property
    def loss(self) -> float:
        return self.avg if self.avg is not None else float("nan")

    def step(self, loss: float, step: int, train_seconds: float, log_every: int, **shown) -> None:
        """One update done: average its loss in; every log_every steps refresh tokens/s and the bar's numbers."""
        if math.isfinite(loss):
            self.avg = loss if self.avg is None else 0.98 * self.avg + 0.02 * loss
        self.bar.update(1)
        if step % log_every == 0 or step == 1:
            self.tok_s = self.tokens / max(train_seconds - self.window_start, 1e-9)
            self.tokens, self.window_start = 0, train_seconds
            self.bar.set_postfix(loss=f"{self.avg or float('nan'):.3f}", tok_s=f"{self.tok_s:.0f}", **shown)


class StopSignals:
    """SIGINT/SIGTERM in the training loop: finish the step, save checkpoint_last.pt, exit 128 + signal number.
    A second signal, or one outside the loop (checkpoint_last.pt is complete then), exits at once.
    received: the first signal this process got (set by the handler at any moment); agreed: the one every rank
    stops for, set by the loop at the step where all ranks stop (under DDP, another rank's signal)."""

    def __init__(self, log, last_good):
        self.log, self.last_good = log, last_good
        self.received: int | None = None
        self.agreed: int | None = None
        self.in_loop = False
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self.handle)

    def uninstall(self) -> None:
        """Back to the handlers from before install(): once training code has returned, a SIGTERM (torchrun's
        for the ranks left when one failed) must end the process where it is, not raise SystemExit inside
        interpreter shutdown (an atexit hook) with a traceback."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    def handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None or not self.in_loop:
            self.log(f"{name}: stopping now; {self.last_good()}")
            raise SystemExit(128 + signum)
        self.received = signum
        self.log(f"{name}: finishing the current step, then saving")


class SkippedUpdates:
    """Updates with a non-finite loss or gradient norm are skipped and logged; max_bad of them in a row stop the
    run, naming the last good checkpoint. in_a_row is reset by every good update; total goes in the checkpoint."""

    def __init__(self, max_bad: int, log, last_good, quiet: bool):
        self.max_bad, self.log, self.last_good, self.quiet = max_bad, log, last_good, quiet
        self.in_a_row, self.total = 0, 0

    def skip(self, step: int, what: str) -> None:
        self.in_a_row += 1
        self.total += 1
        self.log(f"step {step + 1}: non-finite {what}, update skipped ({self.in_a_row} in a row, {self.total} in all)")
        if self.in_a_row >= self.max_bad:  # every rank sees it (all-reduced): rank 0 says it
            raise UserError(f"training diverged: {self.in_a_row} non-finite updates in a row after step {step}; "
                            f"lower train.lr_factor or set train.clip_norm; {self.last_good()}", quiet=self.quiet)


class WeightAverage:
    """An exponential moving average of the weights (Polyak & Juditsky 1992), kept beside the trained model: a
    running alternative to averaging the last checkpoints, scored as one more final-model candidate."""

    def __init__(self, model: Transformer, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def decay_at(self, step: int) -> float:
        """The decay after update `step` (1-based): lower early on, so the random start is forgotten at once
        (TensorFlow's ExponentialMovingAverage with num_updates), then `decay`."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, model: Transformer, step: int) -> None:
        """ema <- d * ema + (1 - d) * w, for every parameter; buffers are not trained and stay as they are."""
        torch._foreach_lerp_(list(self.model.parameters()), list(model.parameters()), 1.0 - self.decay_at(step))


def agree_on_clock(train_seconds: float, master: bool, received: int | None,
                   device: torch.device) -> tuple[float, int | None]:
    """Under DDP every rank takes rank 0's training clock (the same cooldown lr, the same last step) and stops at
    this step if any rank received SIGINT/SIGTERM: returns (rank 0's seconds, the largest signal number received
    on any rank or None), the same on every rank."""
    # max over ranks of (rank 0's clock, 0, ...) is rank 0's clock
    state = torch.tensor([train_seconds if master else 0.0, received or 0], dtype=torch.float64, device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    return float(state[0]), int(state[1]) or None


# ----------------------------------------------------------------------------------------------------------------
# Training


class Trainer:
    """Owns the model, optimizer and data order, so that everything needed for an exact resume is in one place."""

    def __init__(self, cfg: Config, model: Transformer, forward, optimizer: torch.optim.Optimizer,
                 stream: dp.BatchStream, data: dict, rank: int, world: int, device: torch.device):
        """forward: the model with its loss (loss.TranslationLoss) as trained, DDP and/or torch.compile wrapped;
        data: prepared, tokenizer, train, valid, tokenizer_sha256 (see build_trainer)."""
        self.cfg, self.model, self.forward, self.optimizer, self.stream = cfg, model, forward, optimizer, stream
        self.prepared, self.tokenizer = data["prepared"], data["tokenizer"]
        self.train_split, self.valid_split, self.tokenizer_sha256 = data["train"], data["valid"], data["sha256"]
        self.rank, self.world, self.device, self.master = rank, world, device, rank == 0
        self.run_dir = Path(cfg.train.out_dir)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        self.step = 0
        self.best_bleu, self.bad_evals = -1.0, 0
        self.train_seconds = 0.0
        self.last_saved_step = None  # step of the checkpoint_last.pt on disk, for the messages
        self.metrics = MetricsLog(self.run_dir)
        self.signals = StopSignals(self.log, self.last_good)
        self.skips = SkippedUpdates(cfg.train.max_bad_steps, self.log, self.last_good, quiet=not self.master)
        self.ema = WeightAverage(model, cfg.train.ema_decay) if cfg.train.ema_decay > 0 and self.master else None

    # -- state -------------------------------------------------------------------------------------------------

    def state(self, full: bool) -> dict:
        state = {"model": self.model.state_dict(), "config": run_config_dict(self.cfg), "step": self.step,
                 "tokenizer_sha256": self.tokenizer_sha256}
        if full:
            state.update(optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict(),
                         epoch=self.stream.epoch, batch_in_epoch=self.stream.batch_in_epoch,
                         best_bleu=self.best_bleu, bad_evals=self.bad_evals,
                         skipped_steps=self.skips.total, train_seconds=self.train_seconds, rng=rng_state())
            if self.ema is not None:
                state["ema"] = self.ema.model.state_dict()
        return state

    def load_last(self) -> os.stat_result:
        """Exact resume: weights, optimizer, loss scale, data position and every random generator. Reads only:
        the run dir is claimed afterwards (claim_run_dir), so that a refused resume leaves it as it was.
        Returns the os.stat of the file read, for claim_run_dir to see whether it changed meanwhile."""
        last = self.run_dir / "checkpoint_last.pt"
        stat = last.stat() if last.exists() else None
        state = read_resume_state(last, self.tokenizer_sha256)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise UserError(f"checkpoint_last.pt does not match this model config: {one_line(e)}") from None
        self.step = state["step"]
        self.stream.epoch, self.stream.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self.best_bleu, self.bad_evals = state["best_bleu"], state["bad_evals"]
        self.skips.total, self.train_seconds = state["skipped_steps"], state["train_seconds"]
        self.last_saved_step = self.step
        if self.ema is not None:
            self.load_ema(state)
        self.log(f"resumed from step {self.step} (epoch {self.stream.epoch + 1}, batch {self.stream.batch_in_epoch})")
        return stat

    def load_ema(self, state: dict) -> None:
        """A resumed run's weight average goes on from checkpoint_last.pt's, exactly, or starts here if none."""
        if "ema" not in state:  # the run was started without train.ema_decay: average from here on
            self.ema = WeightAverage(self.model, self.ema.decay)
            self.log(f"checkpoint_last.pt holds no weight average (train.ema_decay was 0): it starts at step "
                     f"{self.step}")
            return
        try:
            self.ema.model.load_state_dict(state["ema"])
        except RuntimeError as e:
            raise UserError(f"the weight average in checkpoint_last.pt does not match this model: {one_line(e)}") \
                from None

    def save(self, name: str, full: bool = False) -> None:
        if not self.master:
            return
        if not all(bool(p.isfinite().all()) for p in self.model.parameters()):  # never replace a good file
            raise UserError(f"training diverged: the weights hold NaN/inf at step {self.step}, not writing {name}; "
                            f"{self.last_good()}")
        save_checkpoint(self.state(full), self.run_dir / name)
        if name == "checkpoint_last.pt":
            self.last_saved_step = self.step

    def last_good(self) -> str:
        if self.last_saved_step is None:
            return "no checkpoint_last.pt was written yet"
        return f"checkpoint_last.pt (step {self.last_saved_step}) is the last good one, resume from it"

    def log(self, message: str) -> None:
        if self.master:
            tqdm.write(message, file=sys.stderr)

    # -- data and one update -----------------------------------------------------------------------------------

    def train_step(self, group: list) -> tuple[float, int]:
        """One optimizer update over update_freq batches; gradients are normalised by the update's target tokens
        summed over all ranks, so N ranks equal one process with update_freq * N."""
        t, pad = self.cfg.train, self.tokenizer.pad_id
        lr = learning_rate(self.step + 1, self.cfg.model.d_model, t.warmup, t.lr_factor)
        lr *= cooldown_factor(run_progress(self.step, self.train_seconds, t), t.cooldown)
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
            with contextlib.nullcontext() if sync else self.forward.no_sync():  # compile forwards no_sync
                with autocast(self.device, t.precision):
                    loss, nll = self.forward(src, tgt_in, tgt_out)  # sums over the real target tokens
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
            self.skips.skip(self.step, "gradient" if loss_ok else "loss")
            return float("nan"), 0
        self.skips.in_a_row = 0
        self.step += 1
        if self.ema is not None:
            self.ema.update(self.model, self.step)
        return nll_total / max(ntok / self.world, 1.0), int(ntok)

    # -- evaluation --------------------------------------------------------------------------------------------

    def evaluate(self, train_loss: float, tokens_per_s: float) -> bool:
        """Validation loss, greedy val BLEU, checkpoints; returns True when early stopping says stop."""
        stop = False
        if self.master:
            t = self.cfg.train
            vloss = valid_loss(self.model, self.valid_split, self.cfg, self.device)
            scores = bleu_on(self.model, self.tokenizer, self.prepared, self.cfg.data.valid_split, self.cfg,
                             self.device, beam=1, limit=t.eval_bleu_sentences)[0]
            bleu = selection_bleu(scores, self.cfg)
            improved = bleu > self.best_bleu
            if improved:
                self.best_bleu, self.bad_evals = bleu, 0
                self.save("checkpoint_best.pt")
            else:
                self.bad_evals += 1
            self.save(f"checkpoint_step{self.step}.pt")
            for old in step_checkpoints(self.run_dir)[: -t.keep_last]:
                old.unlink(missing_ok=True)
            self.save("checkpoint_last.pt", full=True)
            record = {"step": self.step, "epoch": self.stream.epoch + 1, "lr": self.optimizer.param_groups[0]["lr"],
                      "train_loss": train_loss, "val_loss": vloss, "val_ppl": math.exp(min(vloss, 50)),
                      "val_bleu": bleu, "tokens_per_s": tokens_per_s, "elapsed_s": self.train_seconds}
            if self.ema is not None:
                record["ema_val_loss"] = valid_loss(self.ema.model, self.valid_split, self.cfg, self.device)
            self.metrics.write(record)
            ema = f" | ema val loss {record['ema_val_loss']:.3f}" if self.ema is not None else ""
            self.log(f"step {self.step} | val loss {vloss:.3f} ppl {record['val_ppl']:.2f}{ema} | val BLEU {bleu:.2f}"
                     f"{' (best)' if improved else ''} | {tokens_per_s:.0f} tok/s")
            stop = bool(t.patience and self.bad_evals >= t.patience)
        if self.world > 1:
            flag = torch.tensor([int(stop)], device=self.device)
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        return stop

    # -- the loop ----------------------------------------------------------------------------------------------

    def train(self) -> None:
        """Updates until max_steps, max_epochs, max_minutes or early stopping; saves checkpoint_last.pt."""
        t = self.cfg.train
        self.signals.install()
        self.model.train()
        batches = iter(self.stream)
        meter = Meter(t.max_steps, self.step, self.train_seconds, self.master)
        t0 = time.perf_counter()
        self.signals.in_loop = True
        try:
            while self.step < t.max_steps:
                group = [[x.to(self.device, non_blocking=True) for x in b]
                         for _, b in zip(range(t.update_freq), batches, strict=False)]
                if not group:
                    self.log(f"reached train.max_epochs={t.max_epochs}")
                    break
                before = self.step
                loss, ntok = self.train_step(group)
                now = time.perf_counter()
                self.train_seconds += now - t0
                # read once: a signal that arrives after this step's agreement must wait for the next step's, or
                # this rank would stop alone while the others wait for it in their next all-reduce
                signum = self.signals.received
                if self.world > 1:
                    self.train_seconds, signum = agree_on_clock(self.train_seconds, self.master, signum, self.device)
                t0 = now
                meter.tokens += ntok
                out_of_time = t.max_minutes and self.train_seconds >= 60 * t.max_minutes
                if self.step > before:  # a skipped (non-finite) update is no step: no log, eval or save for it
                    meter.step(loss, self.step, self.train_seconds, t.log_every,
                               lr=f"{self.optimizer.param_groups[0]['lr']:.2e}", epoch=self.stream.epoch + 1)
                    if self.step % t.eval_every == 0 or self.step >= t.max_steps or out_of_time:
                        if self.evaluate(meter.loss, meter.tok_s):
                            self.log(f"early stopping: no better val BLEU in {t.patience} evaluations")
                            break
                        t0 = time.perf_counter()  # evaluation time is not training time
                    elif t.save_every and self.step % t.save_every == 0:
                        self.save("checkpoint_last.pt", full=True)
                if out_of_time:
                    self.log(f"reached train.max_minutes={t.max_minutes:g}")
                    break
                if signum is not None:
                    self.signals.agreed = signum
                    self.save("checkpoint_last.pt", full=True)
                    self.log(f"{signal.Signals(signum).name} received: saved checkpoint_last.pt at step {self.step}; "
                             f"continue with train.resume=true (--resume)")
                    raise SystemExit(128 + signum)
            self.save("checkpoint_last.pt", full=True)
        finally:
            self.signals.in_loop = False
            meter.bar.close()  # before any message, so that an error starts its own line


# ----------------------------------------------------------------------------------------------------------------
# Building the pieces


def load_data(cfg: Config, world: int, tokenizer_dir: Path | None = None) -> dict:
    """Prepared data, tokenizer and splits; fills cfg.model's vocabulary sizes and pad id from the tokenizer.
    tokenizer_dir: a saved tokenizer to encode the data with (fine-tuning: inherited_tokenizer); None: one is
    trained on the training split as data.* says."""
    # One process per machine prepares the data (machines need not share a disk); the others then find it.
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if world > 1 and not first_on_node:
        dist.barrier()
    try:
        prepared = dp.prepare(cfg.data, tokenizer=tokenizer_dir)
    finally:  # also when it failed: the others must not wait for a barrier that never comes
        if world > 1 and first_on_node:
            dist.barrier()
    tokenizer = dp.load_tokenizer(prepared)
    cfg.model.src_vocab_size = tokenizer.src_vocab_size
    cfg.model.tgt_vocab_size = tokenizer.tgt_vocab_size
    cfg.model.pad_id = tokenizer.pad_id
    if cfg.model.share_embeddings and not tokenizer.joint:
        raise UserError("model.share_embeddings=true needs one joint vocabulary (data.tokenizer=bpe); "
                        "set model.share_embeddings=false")
    data = {"prepared": prepared, "tokenizer": tokenizer, "sha256": dp.tokenizer_fingerprint(prepared),
            "train": dp.load_split(prepared, "train"), "valid": dp.load_split(prepared, cfg.data.valid_split)}
    if len(data["train"]) == 0:  # else the batch stream would loop over empty epochs forever
        raise UserError(f"no training pairs left in {prepared} after dropping blank lines and the "
                        f"data.max_len={cfg.data.max_len} / data.max_len_ratio={cfg.data.max_len_ratio} filter; "
                        "check the training files or raise data.max_len")
    if len(data["valid"]) == 0:  # else found by the first evaluation, after hours of training
        raise UserError(f"the validation split '{cfg.data.valid_split}' is empty; give validation files with "
                        "at least one sentence pair")
    for split in dp.load_meta(prepared)["test_splits"]:  # else found by the final report, after all the training
        if len(dp.load_split(prepared, split)) == 0:
            raise UserError(f"the test split '{split}' is empty; give its files at least one sentence pair, or "
                            "leave it out of data.test_prefixes / data.test_splits")
    validate(cfg)  # again, now that the vocabulary sizes are known (decode.beam is bounded by them)
    return data


def read_init_from(cfg: Config) -> dict | None:
    """Fine-tuning: the weights, file and tokenizer folder of train.init_from (a run dir: the model that
    load_checkpoint picks, as translate.py would; or a .pt file next to its tokenizer/), checked against cfg.
    Read before any data is prepared, so that a mismatch costs seconds. None for a run from scratch, and when
    resuming: the run's own checkpoint_last.pt then holds the weights, and the source's would undo its steps."""
    t = cfg.train
    if not t.init_from or t.resume:
        return None
    try:
        file = find_checkpoint(t.init_from)
        model, tokenizer, source = load_checkpoint(file)  # weights_only: tensors and plain values, never code
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    if file.parent.resolve() == Path(t.out_dir).resolve():  # --overwrite would delete the source
        raise UserError(f"train.init_from {t.init_from} is in train.out_dir itself: fine-tuning starts a new run "
                        "in another train.out_dir; to continue this run, use --resume")
    mismatches = finetune_mismatches(cfg, source)
    if mismatches:
        free = ", ".join(f"model.{k}" for k in FINETUNE_FREE_MODEL_FIELDS)
        raise UserError(f"train.init_from {file}: {'; '.join(mismatches)}: fine-tuning keeps the source's model "
                        f"and tokenizer (of the model only {free} may change); set these as in the source run's "
                        "config.yaml")
    return {"file": file, "model": model.state_dict(), "tokenizer": tokenizer.folder}


def output_vocabulary(cfg: Config, init: dict | None, train: dp.Split,
                      resegment: dp.BpeDropout | None) -> torch.Tensor | None:
    """model.output_vocab 'target': the token ids (Vo,) the decoder may emit, ascending, with cfg.model.output_size
    set to their number. From scratch, every token of the training targets plus eos and unk (with BPE-dropout,
    every piece it could cut them into); fine-tuning keeps the source model's; resuming, the run's own (None: its
    checkpoint holds them)."""
    if cfg.model.output_vocab != "target":
        return None
    saved = load_config_dict(Path(cfg.train.out_dir) / "config.yaml") if cfg.train.resume else None
    if saved is not None:
        cfg.model.output_size = int(saved.get("model", {}).get("output_size", 0))
        return None
    if init is not None:
        ids = init["model"]["output_ids"]
    else:
        counts = np.bincount(np.asarray(train.tgt_tokens), minlength=cfg.model.tgt_vocab_size)  # (V,)
        counts[[dp.EOS_ID, dp.UNK_ID]] += 1
        if resegment is not None:
            counts[resegment.bpe.reachable(resegment.tgt_text)] += 1
        ids = torch.from_numpy(np.flatnonzero(counts))
    cfg.model.output_size = int(ids.numel())
    return ids


def inherited_tokenizer(cfg: Config, init: dict | None) -> Path | None:
    """The saved tokenizer a fine-tuned run encodes its data with (None: the run trains its own). Starting, the
    source's; resuming or reporting, the run's own tokenizer/, a byte copy (the same prepared data), which keeps
    working after the source run was moved or deleted."""
    if init is not None:
        return init["tokenizer"]
    if not cfg.train.init_from:
        return None
    own = Path(cfg.train.out_dir) / "tokenizer"
    if not own.is_dir():
        raise UserError(f"train.resume=true but {own} does not exist: there is no fine-tuned run to resume in "
                        f"{cfg.train.out_dir}")
    return own


def build_optimizer(model: Transformer, t: TrainConfig) -> torch.optim.Optimizer:
    """Adam (§5.3); train.weight_decay > 0 adds AdamW's decoupled decay (Loshchilov & Hutter 2019) of the weight
    matrices and the embedding table only, as fairseq's and nanoGPT's AdamW do."""
    # fused: one kernel for all parameters instead of ~8 ops per tensor (CPU and CUDA; on the CPU 2 ms per
    # update instead of 9 for the Multi30k model, 3% of its step)
    options = {"lr": 0.0, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps, "fused": True}
    if t.weight_decay == 0:  # one group: the optimizer state of runs saved before weight decay existed loads
        return torch.optim.Adam(model.parameters(), **options)
    # gains and biases set a scale and an offset; decaying them towards 0 would only fight the LayerNorm
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": t.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.Adam(groups, decoupled_weight_decay=True, **options)


def build_trainer(cfg: Config, rank: int, world: int, device: torch.device) -> Trainer:
    """Data, run dir, seeded model, sampler, optimizer -> a Trainer (resumed if asked), then DDP/compile.

    Under DDP every rank first learns whether any rank failed to set up (agree_on_setup): a user error then ends
    every process at once, reported once, instead of leaving the others in DDP's first collective."""
    error, trainer = None, None
    try:
        trainer = build_pieces(cfg, rank, world, device)
    except UserError as e:
        error = e
    agree_on_setup(error, world)
    if world > 1:  # DDP's constructor broadcasts rank 0's weights: a collective, so only after the agreement
        trainer.forward = torch.nn.parallel.DistributedDataParallel(
            trainer.forward, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        trainer.forward = torch.compile(trainer.forward)
    if rank == 0:
        save_run_config(cfg, trainer.run_dir / "config.yaml")
        trainer.tokenizer.save(trainer.run_dir / "tokenizer")
    return trainer


def agree_on_setup(error: UserError | None, world: int) -> None:
    """Raise on every rank if any rank failed to set up; rank 0 reports the first failure, the others are quiet."""
    if world == 1:
        if error is not None:
            raise error
        return
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, None if error is None else str(error))
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, message = failed[0]
        raise UserError(message if r == 0 else f"rank {r}: {message}", quiet=dist.get_rank() != 0)


def build_pieces(cfg: Config, rank: int, world: int, device: torch.device) -> Trainer:
    """The Trainer of one process, its forward still the bare model (no collective in here)."""
    t = cfg.train
    init = read_init_from(cfg)
    data = load_data(cfg, world, inherited_tokenizer(cfg, init))
    train = data["train"]
    resegment = dp.BpeDropout(train, data["tokenizer"], t.bpe_dropout, t.seed) if t.bpe_dropout else None
    output_ids = output_vocabulary(cfg, init, train, resegment)
    run_dir = Path(t.out_dir)
    resuming = check_run_dir(cfg, run_dir)  # read-only: a refusal touches nothing
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    model = Transformer(cfg.model).to(device)
    if init is not None:  # the weights alone: optimizer, lr schedule and step count start afresh, a new run
        model.load_state_dict(init["model"])
    elif output_ids is not None:
        model.output_ids.copy_(output_ids)
    sampler = dp.TokenBatchSampler(train.src_lengths, train.tgt_lengths, t.max_tokens, shuffle=True, seed=t.seed,
                                   rank=rank, world_size=world, pad_multiple=t.pad_multiple)
    optimizer = build_optimizer(model, t)
    stream = dp.BatchStream(train, sampler, data["tokenizer"].pad_id, t.pad_multiple, t.max_epochs, resegment,
                            t.src_token_drop)
    objective = TranslationLoss(model, t.label_smoothing, data["tokenizer"].pad_id, data["tokenizer"].unk_id,
                                t.rdrop_alpha)
    trainer = Trainer(cfg, model, objective, optimizer, stream, data, rank, world, device)
    if init is not None:
        trainer.log(f"fine-tuning: weights and tokenizer from {init['file']}; new optimizer and lr schedule")
    resumed_from = trainer.load_last() if resuming else None
    if rank == 0:  # only rank 0 writes, so only rank 0 owns the run dir (its lock)
        claim_run_dir(cfg, run_dir, resumed_from)
        if resuming:
            trainer.metrics.trim(trainer.step)
    return trainer


# ----------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train an encoder-decoder Transformer from a YAML config, then report test BLEU.",
        epilog="Overrides: trailing section.key=value pairs, e.g. train.max_steps=2000 data.vocab_size=10000. "
        "Fine-tune (a new run from a trained run's weights and tokenizer, fresh optimizer and lr schedule): "
        "train.init_from=RUN_DIR_OR_CHECKPOINT train.out_dir=NEW_DIR. "
        "Multi-GPU: torchrun --nproc_per_node=N train_transformer.py --config ...",
    )
    p.add_argument("--config", help="YAML config (see configs/)")
    p.add_argument("--average", metavar="RUN_DIR", help="average the last --last step checkpoints of RUN_DIR and exit")
    p.add_argument("--last", type=int, default=5, help="with --average: how many checkpoints (default 5)")
    p.add_argument("--output", help="with --average: output file (default RUN_DIR/checkpoint_avg.pt)")
    p.add_argument("--report", metavar="RUN_DIR", help="write the final report of a finished run again from its "
                   "config.yaml and checkpoints, without training (trailing overrides: e.g. decode.beam=5)")
    p.add_argument("--resume", action="store_true", help="continue the run in train.out_dir (= train.resume=true) "
                   "from its checkpoint_last.pt, optimizer state included; on a run that reached train.max_steps: "
                   "write its report")
    p.add_argument("--overwrite", action="store_true", help="replace the run in train.out_dir (= train.overwrite=true)")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for user errors")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after --resume etc.
    if sum(map(bool, (args.config, args.average, args.report))) != 1:
        p.error("give one of --config, --average RUN_DIR or --report RUN_DIR")
    run_control(args)
    return args


def run_control(args: argparse.Namespace) -> None:
    """--resume / --overwrite act on this invocation only. train.resume=... / train.overwrite=... on the command
    line mean the same; in a config FILE they are ignored with a warning: a saved config that said overwrite: true
    would otherwise delete its own finished run when run again. Explicit values appended after every other
    override make that so (a malformed override before them still fails with its own message).

    train.init_from=... on the command line with --resume asks for two different things, refused: a fine-tuned
    run's config.yaml records its init_from, and resuming with that file continues the run from its own state."""
    for key in RUN_CONTROL:
        for item in args.overrides:
            if item.startswith(f"train.{key}=") and yaml.safe_load(item.split("=", 1)[1] or "''") is True:
                setattr(args, key, True)
    init_from = [item.split("=", 1)[1].strip("'\" ") for item in args.overrides if item.startswith("train.init_from=")]
    if args.resume and init_from and init_from[-1]:
        raise UserError("train.init_from and --resume (train.resume=true) are both given: --resume continues the run "
                        "in train.out_dir with its own weights and optimizer state, train.init_from starts a NEW run "
                        "from a trained run's weights (fine-tuning); to continue a fine-tuned run, resume it with "
                        "its own config: --config RUN_DIR/config.yaml --resume")
    if args.config:
        file = None
        with contextlib.suppress(UserError):  # an unreadable file is reported by load_config, with the same words
            file = read_yaml(args.config)
        train = file.get("train") if isinstance(file, dict) else None
        for key in RUN_CONTROL:
            if isinstance(train, dict) and train.get(key) is True and not getattr(args, key):
                print(f"warning: train.{key}: true in {args.config} is ignored: it is an action of one command, "
                      f"not a setting; pass --{key}", file=sys.stderr)
    args.overrides += [f"train.{key}={'true' if getattr(args, key) else 'false'}" for key in RUN_CONTROL]


def average_command(args: argparse.Namespace) -> None:
    """--average RUN_DIR: the mean of its last --last step checkpoints, written to --output."""
    run_dir = Path(args.average)
    if args.last < 1:
        raise UserError("--last must be >= 1")
    paths = step_checkpoints(run_dir)[-args.last:]
    if not paths:
        raise UserError(f"no checkpoint_step*.pt files in {run_dir}")
    out = Path(args.output) if args.output else run_dir / "checkpoint_avg.pt"
    check_average_output(out)
    if len(paths) < args.last:  # the run kept fewer (train.keep_last): say so rather than pass it off as asked
        print(f"warning: {run_dir} has only {len(paths)} step checkpoint(s); averaging {len(paths)}, not "
              f"--last {args.last}", file=sys.stderr)
    save_checkpoint(average_checkpoints(paths), out)
    print(f"averaged {', '.join(p.name for p in paths)} -> {out}")


def report_target(args: argparse.Namespace) -> tuple[Config, Path] | None:
    """(config, run dir) when this command is a report: --report RUN_DIR, or --resume of a run whose
    checkpoint_last.pt already reached train.max_steps (training would do nothing; the report was lost)."""
    if args.report:
        run_dir = Path(args.report)
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"--report {run_dir}: no config.yaml there; give the folder of a training run")
        cfg = load_config(run_dir / "config.yaml", [*args.overrides, "train.resume=true"])
        cfg.train.out_dir = str(run_dir)
        return cfg, run_dir
    if not args.resume or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun the loop is a no-op anyway
        return None
    cfg = load_config(args.config, args.overrides)
    last = Path(cfg.train.out_dir) / "checkpoint_last.pt"
    try:  # only the step: mmap reads the small pickle, not the tensors
        step = torch.load(last, map_location="cpu", weights_only=True, mmap=True).get("step")
    except Exception:  # noqa: BLE001 - missing or damaged: the trainer reports it with its own message
        return None
    return (cfg, Path(cfg.train.out_dir)) if isinstance(step, int) and step >= cfg.train.max_steps else None


def report_command(cfg: Config, run_dir: Path) -> None:
    """The final report of a finished run from its checkpoints: same data, model and code as after training."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--report runs in one process; start it with python, not torchrun")
    device = resolve_device(cfg.train.device, "train.device")
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    data = load_data(cfg, 1, inherited_tokenizer(cfg, None))  # cfg.train.resume is set: no init weights
    check_run_dir(cfg, run_dir)  # the same model config as the run's own
    lock_run_dir(run_dir)  # the report rewrites results.json, hyps/ and checkpoint_avg.pt
    state = read_resume_state(run_dir / "checkpoint_last.pt", data["sha256"])
    model = Transformer(cfg.model)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"checkpoint_last.pt does not match this model config: {one_line(e)}") from None
    print(f"{run_dir}: step {state['step']} (train.max_steps {cfg.train.max_steps}); writing the final report "
          "from its checkpoints", file=sys.stderr)
    final_report(model.to(device), data["tokenizer"], data["prepared"], cfg, run_dir, device, state["step"],
                 state["train_seconds"])


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.average:
        return average_command(args)
    if target := report_target(args):
        return report_command(*target)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as e:  # every rank reads the same config: rank 0 says it
        e.quiet = rank != 0
        raise
    ensure_fast_allocator()
    rank, world, device = setup_distributed(cfg.train.device)
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    trainer = None
    try:
        try:
            trainer = build_trainer(cfg, rank, world, device)
            m = cfg.model
            trainer.log(f"model: {count_parameters(trainer.model) / 1e6:.2f} M parameters, {m.attention}, "
                        f"{m.n_enc_layers}+{m.n_dec_layers} layers, d_model {m.d_model}"
                        f"{f', output vocabulary {m.output_size} of {m.tgt_vocab_size}' if m.output_size else ''}"
                        f" | train pairs "
                        f"{len(trainer.train_split)} | {world} process(es) on {device} | {cfg.train.precision} | "
                        f"run dir {trainer.run_dir}")
            trainer.train()
            leave_group(world)
        except SystemExit:
            if trainer is not None and trainer.signals.agreed is not None:
                leave_group(world)  # every rank stopped at the same step (agree_on_clock) and rank 0 has saved
            raise
        except RuntimeError as e:
            if world == 1 or not lost_contact(e):
                raise
            raise UserError(f"lost contact with the other training processes ({one_line(e, 120)}); one of them "
                            f"failed or was killed (torchrun's report names it); "
                            f"{trainer.last_good() if trainer else 'no checkpoint was written'}",
                            quiet=rank != 0) from None
        if trainer.master:  # one process, no collective: the others have already left
            final_report(trainer.model, trainer.tokenizer, trainer.prepared, cfg, trainer.run_dir, device,
                         trainer.step, trainer.train_seconds)
    finally:
        if trainer is not None:
            trainer.signals.uninstall()
            trainer.metrics.close()


def lost_contact(error: RuntimeError) -> bool:
    """Whether a collective failed because another process of the job died or stopped answering (gloo raises a
    plain RuntimeError from inside backward's all-reduce hook, NCCL a DistError)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "timed out"))


def leave_group(world: int) -> None:
    """Every rank leaves the process group together, after the last collective: a rank that tore down its
    connections while another still used them made that one abort (SIGABRT) in 2 of 4 torchrun runs."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_rank() -> NoReturn:
    """One torchrun process from start to end, which then leaves with os._exit: no interpreter finalization.

    Why: building DistributedDataParallel leaves a C++ reference to the gloo process group (measured: its
    gloo_tcp_loop and pt_gloo_runloop threads outlive destroy_process_group, DDP object and model freed), and a
    worker thread that drops its last work while the interpreter finalizes needs the GIL, is unwound and aborts
    the process ("terminate called without an active exception", SIGABRT; pytorch PR 179291). It hit a rank
    that had finished cleanly, and torchrun then killed rank 0 in its final report. Nothing is left to finalize:
    checkpoints and reports are written atomically, the metrics log is closed, and the two streams are flushed."""
    code = 1
    try:
        cli_main(main)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        run_rank()
    cli_main(main)
