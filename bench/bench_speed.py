"""Speed benchmark: training throughput, MFU, cached beam search and attention variants, side by side.

    python bench/bench_speed.py [--quick] [--device cpu|cuda] [--threads N] [--out bench/results.json]
    python bench/bench_speed.py --checkpoint RUN_DIR --data-dir ../shared/data/multi30k --sentences 200
    python bench/bench_speed.py --device cuda --wmt14-base-steps 300 --compile     # GPU: WMT14 base, bf16

Every figure comes from this one process; each configuration is timed `--repeats` times (configurations
interleaved, so a busy machine slows them all alike) and the median is reported.

What is compared, and how:
- Training step = forward + label-smoothed loss (paper §5.4) + backward + Adam (§5.3, eq. 3 learning rate), on
  the same synthetic batches of variable-length sentences (B sentences padded to the longest, a multiple of 8).
  "ours" is transformer_model.Transformer; "naive" is the same model with transformer_model.fast_attention
  monkeypatched to explicit_attention (the textbook matmul/softmax/matmul path, module global replaced for
  that configuration only); "torch" is torch.nn.Transformer with the same dims, pre-norm, dropout, the same
  embedding * sqrt(d) + sinusoid and a tied Linear generator, so parameters and FLOPs are identical.
  "ours" is the project's training step: logits only at real target tokens (Transformer.forward(keep=...)),
  loss by loss.label_smoothed_nll (closed-form gradient); "naive" and "torch" compute logits at
  every padded position and use stock F.cross_entropy(label_smoothing=0.1), what code built on PyTorch's
  modules writes.
  Throughput counts real (non-pad) target tokens per second. On a CPU without native bf16 (no AMX/AVX512-BF16
  in /proc/cpuinfo) autocast emulates bf16, ~7x slower than fp32: those runs time one step each.
- The process re-executes itself with tcmalloc preloaded, as train_transformer.ensure_fast_allocator does
  (NMT_NO_TCMALLOC=1 opts out); threads, torch version, CPU model and the allocator are printed first.
- MFU = model FLOP/s / measured peak. Model FLOPs per step = 3 x forward matmul FLOPs (backward ~ 2x forward)
  counted on the padded shapes: per encoder layer 2BS(4D^2 + 2DF) + 4BS^2D, per decoder layer
  2BT(4D^2 + 2DF) + 4BT^2D (causal counted in full) + 2BT(2D^2) + 2BS(2D^2) + 4BTSD, plus the generator 2NDV
  for the N real target tokens (the useful work: logits at padding are wasted by the configurations doing it).
  The peak is the best, over squares of 1024-2048 (4096-8192 on a GPU) and the model's own linear-layer shapes
  (4096 tokens x d_model/d_ff/vocab), of the median FLOP/s of a matmul in the same precision, measured here.
- Decoding: sentences/s of beam 4 (len penalty 0.6, max length src + 50, §6.1) via decoding.search_texts with
  use_cache True and False. Without --checkpoint the model is randomly initialised with an untied generator
  scaled up so distributions are peaked like a trained model's; its outputs rarely end before the maximum
  length, so they are much longer than a trained model's and the cache speed-up is larger than on real output.
- Attention variants mha, mqa, gqa (n_kv_heads 2), mla (kv_latent_dim 64) at equal d_model: parameters,
  KV-cache bytes per decoded token (bf16 elements, all decoder layers) and cached beam-4 sentences/s (random
  models as above).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from decode_real import bench_engines  # noqa: E402
from decode_real import report_lines as engine_lines  # noqa: E402
from torch import nn  # noqa: E402
from train_real import (  # noqa: E402
    StepTrainer,
    TorchTransformer,
    bench_real_training,
    report_lines,
    sync,
)

import corpora  # noqa: E402
import data_preparation as dp  # noqa: E402
import train_transformer as tt  # noqa: E402
import transformer_model as tm  # noqa: E402
from checkpoint import load_checkpoint  # noqa: E402
from config import load_config  # noqa: E402
from decoding import search_texts  # noqa: E402
from runtime import UserError, cli_main, cpu_info, native_bf16, resolve_device  # noqa: E402

PAD_ID, EOS_ID = 0, 3
NOMINAL_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16 tensor-core peak of the SXM parts (datasheet)
TARGET_TRAIN_RATIO, TARGET_CACHE_RATIO = 1.3, 3.0  # the project's speed targets: x the baseline
TARGET_REAL_MFU = {"fp32": 0.60, "bf16": 0.50}  # and MFU of ours on real batches, of the measured peak


# ---------------------------------------------------------------- settings


def model_config(args, **changes) -> tm.ModelConfig:
    """The Multi30k recipe dims (d 256, 4 heads, 3+3, d_ff 1024, joint vocab 8000, pre-norm); --tiny shrinks them."""
    if args.tiny:
        dims = dict(d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=1, d_ff=64)
    else:
        dims = dict(d_model=256, n_heads=4, n_enc_layers=3, n_dec_layers=3, d_ff=1024)
    cfg = tm.ModelConfig(src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, dropout=0.1, norm_first=True,
                         share_embeddings=True, max_positions=512, **dims)
    return replace(cfg, **changes)


def wmt14_base_config(args) -> tm.ModelConfig:
    """Table 3 base model with the WMT14 En-De shared BPE vocabulary of 37000 (paper §5.1), post-norm as in §3.1."""
    if args.tiny:
        return tm.ModelConfig(src_vocab_size=300, tgt_vocab_size=300, d_model=32, n_heads=4, n_enc_layers=1,
                              n_dec_layers=1, d_ff=64, share_embeddings=True)
    return tm.ModelConfig(src_vocab_size=37000, tgt_vocab_size=37000, d_model=512, n_heads=8, n_enc_layers=6,
                          n_dec_layers=6, d_ff=2048, dropout=0.1, share_embeddings=True)


# ---------------------------------------------------------------- machine facts


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo."""
    return cpu_info("model name") or platform.processor() or "unknown"


def environment(device: torch.device) -> dict:
    cpu, native = cpu_name(), native_bf16(torch.device("cpu"))
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "threads": torch.get_num_threads(), "cpu": cpu, "cpu_native_bf16": native,
           "tcmalloc_preloaded": "tcmalloc" in os.environ.get("LD_PRELOAD", "")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def matmul_peak(device: torch.device, precision: str, shapes: list[tuple[int, int, int]], repeats: int) -> float:
    """Peak FLOP/s: the best over `shapes` (m, k, n) of the median rate of an (m,k) @ (k,n) matmul (2mkn FLOPs).

    Why several shapes, the model's own among them: a CPU BLAS is not fastest on large squares (here a 2048^2
    fp32 matmul ran at about half the rate of the model's (tokens, 1024) @ (1024, 256)), and a peak below what
    the model reaches would give an MFU over 100%."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = torch.randn(k, n, generator=gen).to(device, dtype)
        a @ b  # warm-up: kernel selection, allocator
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        once = max(time.perf_counter() - start, 1e-6)
        inner = max(1, min(1000, int(0.05 / once)))  # time bursts of >= ~50 ms: small matmuls take microseconds
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                a @ b
            sync(device)
            rates.append(2 * m * k * n * inner / (time.perf_counter() - start))
        best = max(best, statistics.median(rates))
    return best


# ---------------------------------------------------------------- training throughput


def synthetic_batches(n: int, batch: int, max_len: int, vocab: int, seed: int, device, mean: float = 13.0,
                      std: float = 5.0, fixed: bool = False) -> list[tuple]:
    """n batches of `batch` sentence pairs, lengths 4..max_len ~ N(mean, std) (Multi30k BPE: 13, 5), padded to the
    batch's longest rounded up to 8 like data_preparation.collate, or to max_len + 1 when `fixed` (one shape for
    torch.compile): (src (B,S), tgt_in (B,T), tgt_out (B,T))."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = (torch.randn(2, batch, generator=gen) * std + mean).round().clamp(4, max_len).long()  # (2,B)
        s_len, t_len = (max_len + 1 if fixed else int(math.ceil((int(lens[i].max()) + 1) / 8) * 8) for i in range(2))
        src = torch.full((batch, s_len), PAD_ID, dtype=torch.long)
        tgt = torch.full((batch, t_len + 1), PAD_ID, dtype=torch.long)  # bos + tokens + eos, split below
        for b in range(batch):
            ls, lt = int(lens[0, b]), int(lens[1, b])
            src[b, :ls] = torch.randint(4, vocab, (ls,), generator=gen)
            src[b, ls] = EOS_ID
            tgt[b, 0] = 2  # bos
            tgt[b, 1:lt + 1] = torch.randint(4, vocab, (lt,), generator=gen)
            tgt[b, lt + 1] = EOS_ID
        out.append((src.to(device), tgt[:, :-1].contiguous().to(device), tgt[:, 1:].contiguous().to(device)))
    return out


def bench_training(args, device, peaks: dict) -> dict:
    cfg = model_config(args)
    batches = synthetic_batches(args.batches, args.batch_size, args.max_len, args.vocab, 1, device)
    trainers = []
    for precision in args.precisions:
        for name, naive in (("ours", False), ("naive", True), ("torch", False)):
            torch.manual_seed(1)
            model = TorchTransformer(cfg) if name == "torch" else tm.Transformer(cfg)
            trainers.append(StepTrainer(name, model, precision, naive, device))
    for tr in trainers:  # warm-up: allocator, kernel selection, Adam state
        for b in batches[:1]:
            tr.step(b)
    # Emulated bf16 (a CPU without AMX/AVX512-BF16) is ~7x slower than fp32: one step per timed run is enough.
    emulated = device.type == "cpu" and not native_bf16(device)
    steps = {p: 1 if p == "bf16" and emulated else args.steps for p in args.precisions}
    for r in range(args.repeats):
        for tr in trainers:
            tr.timed([batches[i % len(batches)] for i in range(steps[tr.precision])])
            print(f"  run {r + 1}/{args.repeats} {tr.name}_{tr.precision}: {tr.tokens[-1] / tr.times[-1]:.0f} tok/s",
                  file=sys.stderr, flush=True)
    out = {"model": asdict(cfg), "batch_size": args.batch_size, "runs": {}}
    for tr in trainers:
        out["runs"][f"{tr.name}_{tr.precision}"] = {**tr.summary(peaks[tr.precision]),
                                                    "steps_per_run": steps[tr.precision]}
    for precision in args.precisions:
        r = out["runs"]
        out[f"speedup_vs_torch_{precision}"] = (r[f"ours_{precision}"]["tokens_per_s"]
                                                / r[f"torch_{precision}"]["tokens_per_s"])
        out[f"speedup_vs_naive_{precision}"] = (r[f"ours_{precision}"]["tokens_per_s"]
                                                / r[f"naive_{precision}"]["tokens_per_s"])
    return out


# ---------------------------------------------------------------- decoding


class IdTokenizer:
    """Stands in for a tokenizer when no Multi30k is at hand: a 'sentence' is its token ids, space-separated."""

    def encode_src(self, text: str) -> list[int]:
        return [int(x) for x in text.split()] + [EOS_ID]


def random_sentences(n: int, vocab: int, seed: int = 2) -> list[str]:
    """n id strings with Multi30k-like BPE lengths (mean ~14, 4..40 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lens = (torch.randn(n, generator=gen) * 5 + 14).round().clamp(4, 40).long().tolist()
    return [" ".join(str(i) for i in torch.randint(4, vocab, (n_tok,), generator=gen).tolist()) for n_tok in lens]


def multi30k_source(args) -> tuple[list[str], Path | None]:
    """(test_2016_flickr source lines, the raw folder) from --data-dir or MULTI30K_DIR; ([], None) without."""
    folder = args.data_dir or os.environ.get("MULTI30K_DIR")
    if not folder or folder == "none":
        return [], None
    folder = Path(folder)
    for name in (f"test_2016_flickr.{args.src_lang}", f"test_2016_flickr.{args.src_lang}.gz"):
        if (folder / name).is_file():
            return corpora.read_lines(folder / name), folder
    raise UserError(f"no test_2016_flickr.{args.src_lang}[.gz] in {folder}: point --data-dir at the Multi30k files")


def bpe_tokenizer(args, raw_dir: Path):
    """The joint BPE of the Multi30k recipe, trained by data_preparation.prepare into --work-dir (or a temp dir)."""
    cfg = load_config(ROOT / "configs" / f"multi30k_{args.src_lang}_{args.tgt_lang}.yaml")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_speed_"))
    data = replace(cfg.data, raw_dir=str(raw_dir), prepared_dir=str(work))
    with contextlib.redirect_stdout(sys.stderr):
        prepared = dp.prepare(data)
    return dp.load_tokenizer(prepared)


def peaked_random_model(cfg: tm.ModelConfig, device, scale: float) -> tm.Transformer:
    """A random model whose (untied) generator is `scale` times the embedding: peaked next-token distributions."""
    torch.manual_seed(3)
    model = tm.Transformer(cfg)
    model.generator.weight = nn.Parameter(model.tgt_embed.weight.detach().clone() * scale)
    return model.to(device).eval()


def decode_rate(model, tokenizer, texts: list[str], use_cache: bool, device, args) -> tuple[float, float, list]:
    """(sentences/s, mean output tokens, hypotheses) of one beam-4 pass over texts."""
    sync(device)
    start = time.perf_counter()
    found = search_texts(model, tokenizer, texts, beam=args.beam, len_penalty=0.6, max_len_a=1.0,
                                   max_len_b=args.max_len_b, use_cache=use_cache, device=device,
                                   precision=args.decode_precision)
    sync(device)
    seconds = time.perf_counter() - start
    hyps = [h[0][0] for h in found]
    return len(texts) / seconds, statistics.mean(len(h) for h in hyps), hyps


def bench_decoding(args, device) -> tuple[dict, dict]:
    """Cached vs uncached beam search, then the four attention variants (cached)."""
    texts, raw_dir = multi30k_source(args)
    trained = None
    if args.checkpoint:
        model, tokenizer, run_cfg = load_checkpoint(args.checkpoint, device)
        trained = model.eval()
        base = run_cfg.model
        if not texts:  # no Multi30k at hand: the checkpoint decodes random ids
            tokenizer, source = IdTokenizer(), "random token sentences"
        else:
            source = "test_2016_flickr"
    elif texts:
        tokenizer = bpe_tokenizer(args, raw_dir)
        base = model_config(args, src_vocab_size=tokenizer.src_vocab_size, tgt_vocab_size=tokenizer.tgt_vocab_size)
        source = "test_2016_flickr"
    else:
        tokenizer, base = IdTokenizer(), model_config(args)
        source = "random token sentences"
    if not texts:
        texts = random_sentences(args.sentences, base.src_vocab_size)
    texts = texts[:args.sentences]
    model = trained if trained is not None else peaked_random_model(base, device, args.generator_scale)
    for use_cache in (True, False):  # warm-up: allocator and kernel selection at every shape
        decode_rate(model, tokenizer, texts[:8], use_cache, device, args)
    runs: dict[str, list] = {"cached": [], "uncached": []}
    lengths, hyps = {}, {}
    for _ in range(args.decode_repeats):
        for name, use_cache in (("cached", True), ("uncached", False)):
            rate, lengths[name], hyps[name] = decode_rate(model, tokenizer, texts, use_cache, device, args)
            runs[name].append(rate)
    same = sum(a == b for a, b in zip(hyps["cached"], hyps["uncached"], strict=True)) / len(texts)
    decoding = {"source": source, "sentences": len(texts), "beam": args.beam, "precision": args.decode_precision,
                "model": "checkpoint " + str(args.checkpoint) if trained is not None else
                f"random init, generator x{args.generator_scale}",
                "cached_sent_per_s": statistics.median(runs["cached"]),
                "uncached_sent_per_s": statistics.median(runs["uncached"]),
                "runs": runs, "mean_output_tokens": lengths["cached"], "same_output_fraction": same}
    decoding["cache_speedup"] = decoding["cached_sent_per_s"] / decoding["uncached_sent_per_s"]

    variants = {}
    kinds = {"mha": {}, "mqa": {}, "gqa": {"n_kv_heads": 2}, "mla": {"kv_latent_dim": 8 if args.tiny else 64}}
    models = {}
    for kind, extra in kinds.items():
        cfg = replace(base, **{"attention": kind, "n_kv_heads": 0, "kv_latent_dim": 0, "q_latent_dim": 0, **extra})
        models[kind] = peaked_random_model(cfg, device, args.generator_scale)
        decode_rate(models[kind], tokenizer, texts[:8], True, device, args)  # warm-up
        variants[kind] = {"params": tm.count_parameters(models[kind]), "kv_cache_bytes_per_token_bf16":
                          tm.kv_cache_bytes_per_token(cfg, 2), "runs": [], **extra}
    for _ in range(args.decode_repeats):
        for kind, model in models.items():
            rate, mean_len, _ = decode_rate(model, tokenizer, texts, True, device, args)
            variants[kind]["runs"].append(rate)
            variants[kind]["mean_output_tokens"] = mean_len
    for v in variants.values():
        v["cached_sent_per_s"] = statistics.median(v["runs"])
    return decoding, {"sentences": len(texts), "source": source, "variants": variants}


# ---------------------------------------------------------------- WMT14 base on synthetic batches (GPU mode)


def bench_wmt14_base(args, device, peaks: dict) -> dict:
    """A few hundred bf16 steps of the base model (Table 3) on synthetic ~25k-token batches (§5.1), optionally
    compiled; MFU against the measured bf16 matmul peak and, on H100/H200, the nominal 989 TFLOP/s."""
    cfg = wmt14_base_config(args)
    precision = "bf16" if "bf16" in args.precisions else args.precisions[0]
    batch = 8 if args.tiny else args.wmt14_batch
    # The trainer's length-sorted token batches hold similar lengths: here 60..79 tokens (little padding), one
    # padded shape of 80 so torch.compile compiles once.
    max_len = 15 if args.tiny else 79
    batches = synthetic_batches(4, batch, max_len, cfg.tgt_vocab_size, 5, device, mean=max_len - 6, std=4.0,
                                fixed=True)
    torch.manual_seed(1)
    tr = StepTrainer("ours", tm.Transformer(cfg), precision, False, device, compile_model=args.compile)
    start = time.perf_counter()
    for b in batches * 2:  # warm-up, including the compilation of each shape
        tr.step(b)
    sync(device)
    warm_s = time.perf_counter() - start
    per_run = max(1, args.wmt14_base_steps // args.repeats)
    for _ in range(args.repeats):
        tr.timed([batches[i % len(batches)] for i in range(per_run)])
    s = tr.summary(peaks[precision])
    out = {"model": asdict(cfg), "precision": precision, "compile": args.compile, "batch_sentences": batch,
           "steps": per_run * args.repeats, "warmup_and_compile_s": warm_s, **s}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    nominal = next((v for k, v in NOMINAL_BF16_TFLOPS.items() if k in gpu), None)
    if nominal and precision == "bf16":
        out["nominal_bf16_tflops"] = nominal
        out["mfu_vs_nominal"] = s["model_tflops"] / nominal
    return out


# ---------------------------------------------------------------- report


def report(results: dict) -> str:
    env = results["env"]
    lines = [f"torch {env['torch']} | {env['device']} | threads {env['threads']} | CPU {env['cpu']} | "
             f"native bf16: {env['cpu_native_bf16']} | tcmalloc preloaded: {env['tcmalloc_preloaded']}"
             + (f" | GPU {env['gpu']}" if "gpu" in env else "")]
    if env["device"] == "cpu" and not env["cpu_native_bf16"]:
        lines.append("note: this CPU has no AMX/AVX512-BF16: bf16 autocast is emulated (slower than fp32 here)")
    peaks = results["matmul_peak_tflops"]
    lines.append("matmul peak (TFLOP/s): " + ", ".join(f"{k} {v:.3f}" for k, v in peaks.items()))
    if "real_training" in results:
        lines += report_lines(results["real_training"])
    if "training" in results:
        tr = results["training"]
        lines += ["", "secondary (synthetic, not what the trainer makes): "
                  f"training step (fwd+bwd+Adam, label smoothing), batch {tr['batch_size']} sentences, "
                  f"median of {len(next(iter(tr['runs'].values()))['runs_tokens_per_s'])} runs of N steps; loss: "
                  "ours logits at real tokens only + loss.label_smoothed_nll, naive and torch logits "
                  "at every position + F.cross_entropy",
                  f"{'config':<14} {'params':>10} {'N':>3} {'tgt tok/s':>10} {'TFLOP/s':>8} {'MFU':>7}"]
        for name, r in tr["runs"].items():
            lines.append(f"{name:<14} {r['params']:>10,} {r['steps_per_run']:>3} {r['tokens_per_s']:>10.0f} "
                         f"{r['model_tflops']:>8.4f} {r['mfu']:>7.1%}")
    if "engines" in results:
        lines += engine_lines(results["engines"])
    if "decoding" in results:
        d = results["decoding"]
        lines += ["", f"decoding beam {d['beam']} ({d['precision']}), {d['sentences']} sentences of {d['source']}, "
                  f"{d['model']}; mean output {d['mean_output_tokens']:.1f} tokens, cached == uncached output for "
                  f"{d['same_output_fraction']:.0%}",
                  f"  cached {d['cached_sent_per_s']:.2f} sent/s   uncached {d['uncached_sent_per_s']:.2f} sent/s   "
                  f"speed-up {d['cache_speedup']:.2f}x"]
        if "random" in d["model"]:
            lines.append("  note: a random model rarely emits eos, so outputs run to the max length (src + b), far "
                         "longer than a trained model's: use --checkpoint RUN_DIR for real figures")
        lines += ["", f"{'attention':<10} {'params':>10} {'KV bytes/token':>15} {'cached sent/s':>14} {'out len':>8}"]
        for kind, v in results["attention_variants"]["variants"].items():
            lines.append(f"{kind:<10} {v['params']:>10,} {v['kv_cache_bytes_per_token_bf16']:>15,} "
                         f"{v['cached_sent_per_s']:>14.2f} {v['mean_output_tokens']:>8.1f}")
    if "wmt14_base" in results:
        w = results["wmt14_base"]
        lines += ["", f"WMT14 base ({w['precision']}, compile={w['compile']}), {w['steps']} steps of "
                  f"{w['batch_sentences']} sentences: {w['tokens_per_s']:,.0f} tgt tok/s, {w['model_tflops']:.1f} "
                  f"TFLOP/s, MFU {w['mfu']:.1%} of the measured peak"
                  + (f", {w['mfu_vs_nominal']:.1%} of the nominal {w['nominal_bf16_tflops']:.0f}"
                     if "mfu_vs_nominal" in w else "") + f" (warm-up/compile {w['warmup_and_compile_s']:.0f} s)"]
    if results.get("targets"):
        lines += ["", "targets"]
        for t in results["targets"]:
            unit = "{:.1%}" if t["name"].startswith("real batches: MFU") else "{:.2f}x"
            lines.append(f"  {t['name']:<44} target >= {unit.format(t['target']):>5}  achieved "
                         f"{unit.format(t['achieved']):>6}  {'PASS' if t['passed'] else 'FAIL'}")
    return "\n".join(lines)


def targets(results: dict) -> list[dict]:
    out = []
    for key, value in results.get("real_training", {}).items():
        if key.startswith("ours_vs_torch_"):
            out.append({"name": f"real batches: tok/s vs nn.Transformer ({key.rsplit('_', 1)[1]})",
                        "target": TARGET_TRAIN_RATIO, "achieved": value, "passed": value >= TARGET_TRAIN_RATIO})
    for name, run in results.get("real_training", {}).get("runs", {}).items():
        precision = name.rsplit("_", 1)[1]
        if name.startswith("ours_") and precision in TARGET_REAL_MFU:
            target = TARGET_REAL_MFU[precision]
            out.append({"name": f"real batches: MFU of ours ({precision})", "target": target,
                        "achieved": run["mfu"], "passed": run["mfu"] >= target})
    if "training" in results:
        for key, value in results["training"].items():
            if key.startswith("speedup_vs_torch_"):
                out.append({"name": f"training tok/s vs nn.Transformer ({key.rsplit('_', 1)[1]})",
                            "target": TARGET_TRAIN_RATIO, "achieved": value, "passed": value >= TARGET_TRAIN_RATIO})
    if "decoding" in results:
        v = results["decoding"]["cache_speedup"]
        out.append({"name": "cached vs uncached beam search", "target": TARGET_CACHE_RATIO, "achieved": v,
                    "passed": v >= TARGET_CACHE_RATIO})
    return out


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Speed benchmark (training, MFU, decoding, attention "
                                "variants); see the module docstring for the definitions.")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    p.add_argument("--out", default="bench/results.json", help="JSON results file")
    p.add_argument("--quick", action="store_true", help="fewer steps and 50 sentences (a minute or two on a CPU)")
    p.add_argument("--tiny", action="store_true", help="toy dims and counts: a smoke test in seconds")
    p.add_argument("--precisions", default="fp32,bf16", help="training precisions, comma-separated")
    p.add_argument("--batch-size", type=int, help="sentences per training batch (default 128)")
    p.add_argument("--max-len", type=int, default=32, help="longest synthetic training sentence")
    p.add_argument("--steps", type=int, help="training steps per timed run (default 4; quick 2)")
    p.add_argument("--repeats", type=int, help="timed runs per configuration, median reported (default 3)")
    p.add_argument("--checkpoint", metavar="RUN_DIR", help="decode with this trained model (a run dir)")
    p.add_argument("--data-dir", help="Multi30k raw folder (default: $MULTI30K_DIR; 'none': random sentences)")
    p.add_argument("--work-dir", help="where the BPE tokenizer is prepared (default: a temp dir)")
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", default="de")
    p.add_argument("--sentences", type=int, help="sentences to decode (default 1000; quick 50)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--decode-precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--decode-repeats", type=int, help="decoding passes per configuration (default 3; quick 1)")
    p.add_argument("--generator-scale", type=float, default=8.0, help="random model: generator = scale x embedding")
    p.add_argument("--skip-decoding", action="store_true")
    p.add_argument("--wmt14-base-steps", type=int, default=0,
                   help="only benchmark N training steps of the WMT14 base model on synthetic batches")
    p.add_argument("--wmt14-batch", type=int, default=320,
                   help="sentences per WMT14-base batch (padded to 80 tokens: ~25k tokens, ~23k real, per side)")
    p.add_argument("--compile", action="store_true", help="torch.compile the WMT14-base model")
    p.add_argument("--recipe", help="training on real batches: this config's data, model and batching "
                   "(default configs/multi30k_en_de.yaml; --tiny: configs/tiny.yaml)")
    p.add_argument("--prepared-dir", help="data.prepared_dir for the recipe (reuse an existing prepared folder)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of the recipe, as on train_transformer.py's command line (repeatable), "
                   "e.g. --set model.output_vocab=target")
    p.add_argument("--real-batches", type=int, help="real batches per timed run (default 20; quick 8; tiny 2)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile contender")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile the project's step on the real batches: the N ops with the most self time")
    p.add_argument("--skip-real", action="store_true", help="leave out training on real batches")
    p.add_argument("--skip-synthetic", action="store_true", help="leave out the synthetic padded training table")
    p.add_argument("--engines", action="store_true", help="with --checkpoint: the engine table (torch fp32/bf16, "
                   "CTranslate2 fp32/int8: speed, BLEU, identical lines) instead of the cache comparison")
    p.add_argument("--decode-split", default="test_2016_flickr", help="--engines: the run's split to translate")
    return p


def fill_defaults(args) -> None:
    quick, tiny = args.quick or args.tiny, args.tiny
    args.vocab = 200 if tiny else 8000
    args.batch_size = args.batch_size or (8 if tiny else 128)
    args.max_len = min(args.max_len, 16) if tiny else args.max_len
    args.steps = args.steps or (1 if tiny else 2 if quick else 4)
    args.batches = min(args.steps, 4)
    args.repeats = args.repeats or (2 if tiny else 3)
    args.sentences = args.sentences or (6 if tiny else 50 if quick else 1000)
    args.decode_repeats = args.decode_repeats or (1 if quick else 3)
    args.max_len_b = 8 if tiny else 50
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    args.recipe = args.recipe or str(ROOT / "configs" / ("tiny.yaml" if tiny else "multi30k_en_de.yaml"))
    args.real_batches = args.real_batches or (2 if tiny else 8 if quick else 20)
    cfg = model_config(args)
    d, f, v = cfg.d_model, cfg.d_ff, args.vocab
    squares = [256] if tiny else [4096, 8192] if args.device.startswith("cuda") else [1024, 2048]
    args.matmul_shapes = [(n, n, n) for n in squares] + ([] if tiny else [(4096, d, f), (4096, f, d), (4096, d, v)])
    if not (tiny or args.skip_real):  # the recipe's own linear shapes too, so its MFU is not over 100%
        recipe = load_config(args.recipe, args.set)
        d, f, v = recipe.model.d_model, recipe.model.d_ff, recipe.data.vocab_size
        args.matmul_shapes += [(4096, d, f), (4096, f, d), (4096, d, v), (4096, d, d)]
    if bad := [p for p in args.precisions if p not in ("fp32", "bf16")]:
        raise UserError(f"--precisions {','.join(bad)}: use fp32 and/or bf16")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be >= 1")


def main(argv) -> int:
    tt.ensure_fast_allocator()  # re-exec with tcmalloc, as the trainer does (NMT_NO_TCMALLOC=1 opts out)
    args = build_parser().parse_args(argv)
    fill_defaults(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device, "--device")
    results = {"env": environment(device), "settings": {k: v for k, v in vars(args).items()}}
    print(report({"env": results["env"], "matmul_peak_tflops": {}}).split("\n")[0], file=sys.stderr, flush=True)
    slow_bf16 = device.type == "cpu" and not results["env"]["cpu_native_bf16"]  # emulated: seconds per matmul
    peaks = {p: matmul_peak(device, p, args.matmul_shapes[:1] if p == "bf16" and slow_bf16 else args.matmul_shapes,
                            args.repeats) for p in ("fp32", "bf16")}
    results["matmul_peak_tflops"] = {p: v / 1e12 for p, v in peaks.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a long run interrupted late still leaves its figures
        out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")

    seconds = results["seconds"] = {}
    start = time.perf_counter()
    if args.wmt14_base_steps > 0:
        results["wmt14_base"] = bench_wmt14_base(args, device, peaks)
    else:
        if not args.skip_real:
            print(f"training on real batches of {args.recipe} ...", file=sys.stderr, flush=True)
            results["real_training"] = bench_real_training(args, device, peaks)
            seconds["real_training"] = time.perf_counter() - start
            save()
        if not args.skip_synthetic:
            print("training on synthetic padded batches ...", file=sys.stderr, flush=True)
            results["training"] = bench_training(args, device, peaks)
            seconds["training"] = time.perf_counter() - start
            save()
        if args.engines:
            if not args.checkpoint:
                raise UserError("--engines needs --checkpoint RUN_DIR (a trained run)")
            print("decoding with each engine ...", file=sys.stderr, flush=True)
            results["engines"] = bench_engines(args, device)
            save()
        elif not args.skip_decoding:
            print(f"decoding ... ({time.perf_counter() - start:.0f} s so far)", file=sys.stderr, flush=True)
            results["decoding"], results["attention_variants"] = bench_decoding(args, device)
    seconds["total"] = time.perf_counter() - start
    results["targets"] = targets(results)
    print(report(results), flush=True)
    save()
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli_main(main)
