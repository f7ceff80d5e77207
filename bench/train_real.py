"""Training speed on the batches the trainer really makes (issue 16): bench_speed.py's primary training table.

The batches are the first N of epoch 1 from the trainer's own TokenBatchSampler and collate (train_transformer.
build_pieces on a recipe file), the same batches in the same order for every contender:
- "ours":         Trainer.train_step exactly as train_transformer.py runs it (loss.TranslationLoss: the output
                  projection fused into the label-smoothed loss, at real target tokens only; gradient normalised by
                  target tokens, Adam with the recipe's schedule);
- "ours+compile": the same Trainer with its forward under torch.compile, as train.compile=true makes it;
- "torch":        torch.nn.Transformer with the same dims (bench_speed.TorchTransformer), logits at every position
                  and stock F.cross_entropy(label_smoothing), Adam with the same schedule; over the same output
                  vocabulary as ours when the recipe sets model.output_vocab: target.
Contenders are interleaved within every repeat, so a busy machine slows them alike; the median is reported.
MFU = 3 x forward matmul FLOPs on the padded shapes (bench_speed.forward_flops) / time / the measured matmul peak
of the same precision, which includes the model's own shapes (bench_speed.matmul_peak).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import train_transformer as tt
import transformer_model as tm
from config import load_config
from loss import label_smoothed_nll
from runtime import autocast, native_bf16

PAD_ID = 0  # data_preparation.SPECIALS
ROOT = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the contenders (also bench_speed's synthetic table)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer wrapped with the same embeddings, sinusoid and tied generator as ours: the baseline."""

    def __init__(self, cfg: tm.ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = tm.PositionalEncoding(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first": training ignores it
            warnings.simplefilter("ignore")
            self.core = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_enc_layers, cfg.n_dec_layers, cfg.d_ff,
                                       cfg.dropout, batch_first=True, norm_first=cfg.norm_first)
        self.generator = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        self.generator.weight = self.embed.weight  # three-way tying, like share_embeddings=True
        self.register_buffer("output_ids", None)  # a recipe's output_vocab 'target': ours' ids, set by contenders()

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model)  # (B,T,D)
        return self.dropout(x + self.positions(tokens.size(1)))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        t = tgt_in.size(1)
        src_ignore = src == self.cfg.pad_id  # (B,S) torch's convention: True = may NOT attend
        future = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)  # (T,T) True = masked
        h = self.core(self.embed_tokens(src), self.embed_tokens(tgt_in), tgt_mask=future,
                      src_key_padding_mask=src_ignore, memory_key_padding_mask=src_ignore, tgt_is_causal=True)
        if self.output_ids is None:
            return self.generator(h)  # (B,T,V)
        return F.linear(h, self.generator.weight.index_select(0, self.output_ids))  # (B,T,Vo)


def explicit_only(q, k, v, mask, dropout_p):
    """fast_attention's signature, computed by the textbook path (the weights are dropped)."""
    return tm.explicit_attention(q, k, v, mask, dropout_p)[0]


@contextlib.contextmanager
def attention_path(naive: bool):
    """Swap transformer_model.fast_attention for the explicit path while a 'naive' configuration runs."""
    if not naive:
        yield
        return
    saved = tm.fast_attention
    tm.fast_attention = explicit_only
    try:
        yield
    finally:
        tm.fast_attention = saved


def forward_flops(cfg: tm.ModelConfig, b: int, s: int, t: int, n: int) -> float:
    """Matmul FLOPs of one forward pass: layers on the padded shapes, generator on the n real target tokens."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.output_size or cfg.tgt_vocab_size
    enc = 2 * b * s * (4 * d * d + 2 * d * f) + 4 * b * s * s * d
    dec = (2 * b * t * (4 * d * d + 2 * d * f) + 4 * b * t * t * d
           + 2 * b * t * 2 * d * d + 2 * b * s * 2 * d * d + 4 * b * t * s * d)
    return cfg.n_enc_layers * enc + cfg.n_dec_layers * dec + 2 * n * d * v


class StepTrainer:
    """One model + Adam; step() runs a full training step on a batch and returns its real target tokens."""

    def __init__(self, name: str, model: nn.Module, precision: str, naive: bool, device, compile_model=False):
        self.name, self.precision, self.naive, self.device = name, precision, naive, device
        self.model = model.to(device).train()
        self.forward = torch.compile(self.model) if compile_model else self.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
        self.n_steps = 0
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.flops: list[float] = []

    def step(self, batch, label_smoothing: float = 0.1, lr=None) -> int:
        """lr: step -> learning rate (default eq. 3 with warmup 4000)."""
        src, tgt_in, tgt_out = batch
        self.n_steps += 1
        for g in self.opt.param_groups:
            g["lr"] = lr(self.n_steps) if lr else tt.learning_rate(self.n_steps, self.model.cfg.d_model, warmup=4000)
        ntok = int(tgt_out.ne(PAD_ID).sum())
        self.opt.zero_grad(set_to_none=True)
        ours = self.name == "ours"
        keep = tgt_out.ne(PAD_ID)  # (B,T) real target tokens
        with attention_path(self.naive), autocast(self.device, self.precision):
            logits = self.forward(src, tgt_in, keep=keep) if ours else self.forward(src, tgt_in)  # (N,V) / (B,T,V)
        if ours:  # the project's training step: logits of real tokens only, closed-form loss gradient
            loss, _ = label_smoothed_nll(logits, tgt_out[keep], label_smoothing, PAD_ID)
        else:  # stock PyTorch: log_softmax + NLL under autograd
            target = tgt_out
            ids = getattr(self.model, "output_ids", None)
            if ids is not None:  # token ids -> rows of the output vocabulary (it holds every training target)
                target = torch.searchsorted(ids, tgt_out)
            loss = F.cross_entropy(logits.float().flatten(0, 1), target.masked_fill(~keep, -100).flatten(),
                                   ignore_index=-100, label_smoothing=label_smoothing, reduction="sum")
        (loss / ntok).backward()
        self.opt.step()
        return ntok

    def timed(self, batches: list) -> None:
        """Run the batches once, timing the whole; record tokens and FLOPs."""
        sync(self.device)
        start = time.perf_counter()
        ntok = sum(self.step(b) for b in batches)
        sync(self.device)
        self.times.append(time.perf_counter() - start)
        self.tokens.append(ntok)
        self.flops.append(sum(3 * forward_flops(self.model.cfg, *b[0].shape, b[1].size(1), int(b[2].ne(PAD_ID).sum()))
                              for b in batches))

    def summary(self, peak: float) -> dict:
        rates = [n / s for n, s in zip(self.tokens, self.times, strict=True)]
        flops = [f / s for f, s in zip(self.flops, self.times, strict=True)]
        return {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
                "model_tflops": statistics.median(flops) / 1e12, "mfu": statistics.median(flops) / peak,
                "params": tm.count_parameters(self.model)}



# ---------------------------------------------------------------- real batches




def real_setup(recipe: str, prepared_dir: str | None, precision: str, device: torch.device,
               out_dir: str, settings: list[str] | None = None) -> tt.Trainer:
    """A Trainer built by the trainer's own code from a recipe file, with a throw-away run dir. Relative paths in
    the recipe are read from the repository root, as train_transformer.py run from there reads them."""
    overrides = [f"train.out_dir={out_dir}", f"train.precision={precision}", "train.overwrite=true",
                 f"train.device={device}", "train.compile=false"]
    if prepared_dir:
        overrides.append(f"data.prepared_dir={prepared_dir}")
    cfg = load_config(recipe, [*(settings or []), *overrides])
    with contextlib.chdir(ROOT):
        return tt.build_pieces(cfg, 0, 1, device)


def take_batches(trainer: tt.Trainer, n: int) -> list[tuple]:
    """The first n batches of the trainer's epoch 1, moved to its device."""
    out = []
    for batch in trainer.stream:
        out.append(tuple(x.to(trainer.device) for x in batch))
        if len(out) == n:
            break
    return out


class Contender:
    """One way of training on the batches; run() times one pass and records tokens, FLOPs and seconds."""

    def __init__(self, name: str, precision: str, step, cfg):
        self.name, self.precision, self.step_fn, self.cfg = name, precision, step, cfg
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.flops: list[float] = []
        self.warmup_s = 0.0
        self.recipe_steps = 0  # train.max_steps of the recipe (set on the first contender)

    def warm(self, batches: list) -> None:
        """Untimed steps over every batch shape once: allocator, kernel choice, compilation (its time is kept)."""
        start = time.perf_counter()
        for b in batches:
            self.step_fn(b)
        self.warmup_s = time.perf_counter() - start

    def run(self, batches: list, flops_of) -> None:
        start = time.perf_counter()
        ntok = 0
        for b in batches:
            self.step_fn(b)
            ntok += int(b[2].ne(self.cfg.pad_id).sum())
        sync(batches[0][0].device)
        self.times.append(time.perf_counter() - start)
        self.tokens.append(ntok)
        self.flops.append(sum(flops_of(b) for b in batches))

    def summary(self, peak: float) -> dict:
        rates = [n / s for n, s in zip(self.tokens, self.times, strict=True)]
        flops = statistics.median(f / s for f, s in zip(self.flops, self.times, strict=True))
        return {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates, "model_tflops": flops / 1e12,
                "mfu": flops / peak, "warmup_s": self.warmup_s}


def contenders(recipe: str, prepared_dir: str | None, precision: str, device: torch.device, work: str,
               n_batches: int, with_compile: bool,
               settings: list[str] | None = None) -> tuple[list[Contender], list, object]:
    """(contenders, batches, model config) for one precision; each contender starts from the same seeded weights.
    settings: section.key=value overrides of the recipe (bench_speed.py --set)."""
    ours = real_setup(recipe, prepared_dir, precision, device, f"{work}/ours_{precision}", settings)
    batches = take_batches(ours, n_batches)
    cfg = ours.cfg.model
    out = [Contender("ours", precision, lambda b: ours.train_step([b]), cfg)]
    out[0].recipe_steps = ours.cfg.train.max_steps
    if with_compile:
        compiled = real_setup(recipe, prepared_dir, precision, device, f"{work}/compiled_{precision}", settings)
        compiled.forward = torch.compile(compiled.forward)  # the model with its fused loss, as the trainer compiles it
        out.append(Contender("ours+compile", precision, lambda b: compiled.train_step([b]), cfg))
    torch.manual_seed(ours.cfg.train.seed)
    torch_model = TorchTransformer(cfg)
    torch_model.output_ids = ours.model.output_ids  # the same output vocabulary (None: all of it)
    base = StepTrainer("torch", torch_model, precision, False, device)
    t = ours.cfg.train
    base_lr = lambda step: tt.learning_rate(step, cfg.d_model, t.warmup, t.lr_factor)  # noqa: E731

    def torch_step(b):
        base.step(b, label_smoothing=t.label_smoothing, lr=base_lr)

    out.append(Contender("torch", precision, torch_step, cfg))
    return out, batches, cfg


def bench_precision(args, device: torch.device, precision: str, peak: float, work: str) -> dict:
    """Every contender in one precision on the same real batches, interleaved per repeat."""
    group, batches, cfg = contenders(args.recipe, args.prepared_dir, precision, device, work, args.real_batches,
                                     not args.no_compile, args.set)
    pad = cfg.pad_id

    def flops_of(b) -> float:
        return 3 * forward_flops(cfg, *b[0].shape, b[1].size(1), int(b[2].ne(pad).sum()))

    for c in group:
        print(f"  warm-up {c.name}_{precision} ...", file=sys.stderr, flush=True)
        c.warm(batches)
    for r in range(args.repeats):
        for c in group:
            c.run(batches, flops_of)
            print(f"  run {r + 1}/{args.repeats} {c.name}_{precision}: {c.tokens[-1] / c.times[-1]:.0f} tok/s",
                  file=sys.stderr, flush=True)
    shapes = [(*b[0].shape, b[1].size(1)) for b in batches]
    runs = {f"{c.name}_{precision}": c.summary(peak) for c in group}
    steps = group[0].recipe_steps
    per_step = statistics.mean(int(b[2].ne(pad).sum()) for b in batches)  # real target tokens per update
    for r in runs.values():  # the compile decision: its warm-up counts once over a whole run of the recipe
        r["recipe_minutes"] = (steps * per_step / r["tokens_per_s"] + r["warmup_s"]) / 60
    return {"model": asdict(cfg), "runs": runs, "recipe_steps": steps,
            "mean_real_target_fraction": statistics.mean(float(b[2].ne(pad).float().mean()) for b in batches),
            "mean_batch_shape": [statistics.mean(s[i] for s in shapes) for i in range(3)]}


def bench_real_training(args, device: torch.device, peaks: dict) -> dict:
    """Target tokens/s, TFLOP/s and MFU of each contender in each precision on the trainer's real batches; bf16
    only where the hardware has it (emulated bf16 on an AVX2 CPU is many times slower than fp32: nobody trains so)."""
    precisions = [p for p in args.precisions if p == "fp32" or native_bf16(device)]
    result = {"recipe": args.recipe, "settings": args.set, "batches": args.real_batches, "repeats": args.repeats,
              "runs": {}}
    with tempfile.TemporaryDirectory() as work:
        for precision in precisions:
            one = bench_precision(args, device, precision, peaks[precision], work)
            result["runs"].update(one.pop("runs"))
            result.update(one)
            runs = result["runs"]
            result[f"ours_vs_torch_{precision}"] = (runs[f"ours_{precision}"]["tokens_per_s"]
                                                   / runs[f"torch_{precision}"]["tokens_per_s"])
            if not args.no_compile:
                result[f"compile_vs_ours_{precision}"] = (runs[f"ours+compile_{precision}"]["tokens_per_s"]
                                                         / runs[f"ours_{precision}"]["tokens_per_s"])
            if args.profile:
                result.setdefault("profile", {})[precision] = profile_ours(args, device, precision, work,
                                                                           args.profile)
    return result


def profile_ours(args, device: torch.device, precision: str, work: str, top: int = 12) -> list[dict]:
    """Where the time of the project's step goes: torch.profiler self time per op over the real batches (after
    one warm-up pass), the `top` largest as {op, self_ms, share}; share is of all self time (CPU, or GPU on CUDA)."""
    ours = real_setup(args.recipe, args.prepared_dir, precision, device, f"{work}/profile_{precision}", args.set)
    batches = take_batches(ours, args.real_batches)
    for b in batches:
        ours.train_step([b])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for b in batches:
            ours.train_step([b])
        sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    return [{"op": e.key, "self_ms": getattr(e, attr) / 1e3, "share": getattr(e, attr) / total} for e in events[:top]]


def report_lines(tr: dict) -> list[str]:
    """The real-batch training table for bench_speed.report."""
    shape = tr["mean_batch_shape"]
    recipe = " ".join([tr["recipe"], *tr.get("settings", [])])
    lines = ["", f"training on real batches: the first {tr['batches']} batches of {recipe} (the trainer's "
             f"sampler and collate; mean batch {shape[0]:.0f} sentences x {shape[1]:.1f} source x {shape[2]:.1f} "
             f"target tokens, {tr['mean_real_target_fraction']:.0%} real target tokens), median of {tr['repeats']}",
             f"{'config':<20} {'tgt tok/s':>10} {'TFLOP/s':>8} {'MFU':>7} {'warm-up s':>10} "
             f"{'min for ' + str(tr['recipe_steps']) + ' updates':>22}"]
    for name, r in tr["runs"].items():
        lines.append(f"{name:<20} {r['tokens_per_s']:>10.0f} {r['model_tflops']:>8.4f} {r['mfu']:>7.1%} "
                     f"{r['warmup_s']:>10.1f} {r['recipe_minutes']:>22.1f}")
    for key, value in tr.items():
        if key.startswith(("ours_vs_torch_", "compile_vs_ours_")):
            lines.append(f"  {key}: {value:.2f}x")
    for precision, rows in tr.get("profile", {}).items():
        lines += ["", f"profile of ours_{precision} over the same {tr['batches']} batches (torch.profiler, self time)",
                  f"{'op':<60} {'ms':>9} {'share':>7}"]
        lines += [f"{r['op'][:60]:<60} {r['self_ms']:>9.1f} {r['share']:>7.1%}" for r in rows]
    return lines
