"""Decoding a trained model with each engine (issue 15): bench_speed.py's decoding table for a real run.

    python bench/bench_speed.py --checkpoint runs/multi30k_en_de --engines --skip-real --skip-synthetic

The same sentences (the run's prepared test split, default test_2016_flickr) and the same search settings (the
run's decode section: beam, length penalty, max length) for every engine:
- torch fp32 and torch bf16 (bf16 only where the CPU/GPU has it natively): translator.Translator, the code
  translate.py runs, batching by tokens;
- CTranslate2 float32 and int8: the run exported by export.export_ctranslate2 into a temporary folder, decoded by
  ct2_engine through the same Translator (engine="ctranslate2"; our tokenizer, length penalty and limits), with
  as many threads as torch uses.
Timed: the translation call only (model loading and export excluded), median of --decode-repeats passes.
Reported: sentences/s, target tokens/s (output BPE tokens, eos included), cased sacreBLEU and tokenized
lowercased BLEU against the references, and the share of output lines identical to torch fp32's.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import ct2_engine
import data_preparation as dp
from export import export_ctranslate2
from runtime import native_bf16
from scoring import score
from translator import Translator


def timed(translate, sources: list[str], repeats: int) -> tuple[list[str], float]:
    """(outputs, median seconds of one pass)."""
    times, out = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = translate(sources)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def engines(run: str, device: torch.device, work: Path):
    """(name, translate(list[str]) -> list[str]) for every engine this machine can run."""
    for precision in ("fp32", "bf16"):
        if precision == "bf16" and not native_bf16(device):
            continue
        tr = Translator.load(run, device=str(device), precision=precision)
        yield f"torch {precision}", lambda s, tr=tr: [t.text for t in tr.translate(s)]
    if device.type != "cpu":
        return
    try:
        ct2_engine.require_ctranslate2()
    except Exception as e:  # noqa: BLE001 - optional dependency: say so in the table's stead
        print(f"  CTranslate2 left out: {e}", file=sys.stderr)
        return
    folder = export_ctranslate2(run, work / "ct2", force=True)
    for precision in ("fp32", "int8"):
        tr = Translator.load(folder, device="cpu", precision=precision, engine="ctranslate2")
        yield f"ctranslate2 {precision}", lambda s, tr=tr: [t.text for t in tr.translate(s)]


def bench_engines(args, device: torch.device) -> dict:
    """The decoding table of a trained run: one row per engine."""
    run = args.checkpoint
    torch_fp32 = Translator.load(run, device="cpu")
    cfg, tokenizer = torch_fp32.cfg, torch_fp32.tokenizer
    if args.prepared_dir:
        cfg.data.prepared_dir = args.prepared_dir
    prepared = dp.prepare(cfg.data)  # the run's own prepared folder (found, not rebuilt): its test split
    split = args.decode_split
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    sources, refs = (dp.read_raw(prepared, split, lang)[: args.sentences] for lang in (src, tgt))
    d = cfg.decode
    result = {"run": str(run), "split": split, "sentences": len(sources), "beam": d.beam,
              "len_penalty": d.len_penalty, "threads": torch.get_num_threads(), "rows": {}}
    reference_out = None
    with tempfile.TemporaryDirectory() as work:
        for name, translate in engines(run, device, Path(work)):
            print(f"  decoding with {name} ...", file=sys.stderr, flush=True)
            translate(sources[:8])  # warm-up: allocator, kernel choice
            out, seconds = timed(translate, sources, args.decode_repeats)
            reference_out = reference_out or out
            tokens = sum(len(tokenizer.encode_tgt(h)) + 1 for h in out)
            s = score(out, refs, tgt)
            result["rows"][name] = {"seconds": seconds, "sent_per_s": len(sources) / seconds,
                                    "tgt_tok_per_s": tokens / seconds, "bleu": s["bleu"],
                                    "bleu_tok_lc": s["bleu_tok_lc"],
                                    "identical_to_torch_fp32": sum(a == b for a, b in zip(out, reference_out,
                                                                                         strict=True)) / len(out)}
    rows = result["rows"]
    if "ctranslate2 fp32" in rows:
        result["torch_vs_ct2_fp32"] = rows["torch fp32"]["sent_per_s"] / rows["ctranslate2 fp32"]["sent_per_s"]
        result["int8_bleu_drop"] = rows["ctranslate2 fp32"]["bleu"] - rows["ctranslate2 int8"]["bleu"]
    return result


def report_lines(e: dict) -> list[str]:
    """The engine table for bench_speed.report."""
    lines = ["", f"decoding {e['sentences']} sentences of {e['split']} with {e['run']}: beam {e['beam']}, length "
             f"penalty {e['len_penalty']}, {e['threads']} threads; translation call only, median of passes",
             f"{'engine':<18} {'sent/s':>8} {'tgt tok/s':>10} {'BLEU':>6} {'tok.lc':>7} {'same as torch fp32':>19}"]
    for name, r in e["rows"].items():
        lines.append(f"{name:<18} {r['sent_per_s']:>8.1f} {r['tgt_tok_per_s']:>10.0f} {r['bleu']:>6.2f} "
                     f"{r['bleu_tok_lc']:>7.2f} {r['identical_to_torch_fp32']:>19.1%}")
    if "torch_vs_ct2_fp32" in e:
        lines.append(f"  torch fp32 / CTranslate2 fp32: {e['torch_vs_ct2_fp32']:.2f}x (target >= 0.8x); "
                     f"int8 BLEU drop {e['int8_bleu_drop']:.2f} (target <= 0.3)")
    return lines
