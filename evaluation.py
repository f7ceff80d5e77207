"""Evaluation of a model during and after training: validation loss, BLEU on a split, and the final report of a
finished run (best vs. averaged weights chosen on validation BLEU, beam search on every test split, tables,
results.json, hyps/, curves.png)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import data_preparation as dp
from checkpoint import average_checkpoints, read_checkpoint, save_checkpoint, step_checkpoints
from config import Config
from decoding import clean, translate_texts
from loss import label_smoothed_nll
from rundir import read_metrics
from runtime import autocast, resolve_precision, write_text
from scoring import score
from transformer_model import Transformer, count_parameters


@torch.inference_mode()
def valid_loss(model: Transformer, split: dp.Split, cfg: Config, device: torch.device) -> float:
    """Mean NLL per target token (nats) of a split, in the training precision, without dropout."""
    was_training = model.training
    model.eval()
    pad = cfg.model.pad_id
    sampler = dp.TokenBatchSampler(split.src_lengths, split.tgt_lengths, cfg.train.max_tokens, shuffle=False,
                                   seed=0, pad_multiple=cfg.train.pad_multiple)
    total, count = 0.0, 0
    for indices in sampler:
        src, tgt_in, tgt_out = (x.to(device) for x in dp.collate(split, indices, pad, cfg.train.pad_multiple))
        keep = tgt_out.ne(pad)  # (B,T) real target tokens
        with autocast(device, cfg.train.precision):  # the logits of the output vocabulary only: no -inf columns
            logits = F.linear(model.features(src, tgt_in, keep), model.output_weight())  # (N,Vo)
        target = model.output_rows(tgt_out[keep], dp.UNK_ID)  # (N,)
        total += float(label_smoothed_nll(logits, target, 0.0, pad_id=-1)[1])  # -1: no padding left to mask
        count += int(keep.sum())
    model.train(was_training)
    return total / max(count, 1)


def bleu_on(model: Transformer, tokenizer: dp.Tokenizer, prepared: Path, split: str, cfg: Config,
            device: torch.device, beam: int, limit: int = 0, progress: bool = False) -> tuple[dict, list[str]]:
    """(scores, hypotheses) of the model on a valid/test split of the prepared data; beam 1 = greedy. Decoded in
    decode.precision, not the training precision, so translate.py's defaults reproduce the scores."""
    d, dec = cfg.data, cfg.decode
    sources = dp.read_raw(prepared, split, d.src_lang)
    refs = dp.read_raw(prepared, split, d.tgt_lang)
    if limit:
        sources, refs = sources[:limit], refs[:limit]
    hyps = translate_texts(model, tokenizer, sources, beam=beam, len_penalty=dec.len_penalty,
                           max_len_a=dec.max_len_a, max_len_b=dec.max_len_b, batch_tokens=dec.batch_tokens,
                           device=device, precision=resolve_precision(dec.precision, device),
                           progress=progress and beam > 1)
    return score(hyps, refs, d.tgt_lang), hyps


def selection_bleu(scores: dict, cfg: Config) -> float:
    """The BLEU that picks checkpoints: cased sacreBLEU, or with data.lowercase the tokenized lowercased BLEU
    (against cased references a lowercase model's cased score mostly counts the capitals it cannot write)."""
    return scores["bleu_tok_lc" if cfg.data.lowercase else "bleu"]


def choose_weights(model: Transformer, tokenizer: dp.Tokenizer, prepared: Path, cfg: Config, run_dir: Path,
                   device: torch.device) -> tuple[str, dict]:
    """Load into model the best of checkpoint_best.pt, the average of the last step checkpoints and the weight
    average (train.ema_decay), judged by greedy validation BLEU; returns (name, {name: BLEU}). Keeps
    checkpoint_avg.pt / checkpoint_ema.pt only when it wins, since translate.py prefers them to checkpoint_best.pt."""
    t = cfg.train
    candidates = {}
    if (run_dir / "checkpoint_best.pt").exists():
        candidates["best"] = run_dir / "checkpoint_best.pt"
    recent = step_checkpoints(run_dir)[-t.average_last:] if t.average_last > 1 else []
    if len(recent) > 1:
        save_checkpoint(average_checkpoints(recent), run_dir / "checkpoint_avg.pt")
        candidates[f"avg{len(recent)}"] = run_dir / "checkpoint_avg.pt"
    if t.ema_decay > 0 and (ema := weight_average(run_dir / "checkpoint_last.pt")) is not None:
        save_checkpoint(ema, run_dir / "checkpoint_ema.pt")
        candidates["ema"] = run_dir / "checkpoint_ema.pt"
    val = {}
    for name, path in candidates.items():
        model.load_state_dict(read_checkpoint(path)["model"])
        val[name] = selection_bleu(bleu_on(model, tokenizer, prepared, cfg.data.valid_split, cfg, device, beam=1)[0],
                                   cfg)
    chosen = max(val, key=val.get) if val else "last"
    if chosen != "last":
        model.load_state_dict(read_checkpoint(candidates[chosen])["model"])
    for name, path in candidates.items():
        if name not in (chosen, "best"):
            path.unlink()
    return chosen, val


def weight_average(last: Path) -> dict | None:
    """The trainer's moving average of the weights (checkpoint_last.pt's "ema") as a checkpoint of its own."""
    if not last.exists():
        return None
    state = read_checkpoint(last)
    if "ema" not in state:
        return None
    keep = ("config", "step", "tokenizer_sha256")
    return {"model": state["ema"], **{k: state[k] for k in keep if k in state}}


def final_report(model: Transformer, tokenizer: dp.Tokenizer, prepared: Path, cfg: Config, run_dir: Path,
                 device: torch.device, step: int, train_seconds: float) -> dict:
    """Pick best vs. averaged weights on val BLEU, then beam-search every test split (paper §6.1)."""
    d, dec = cfg.data, cfg.decode
    chosen, val = choose_weights(model, tokenizer, prepared, cfg, run_dir, device)
    precision = resolve_precision(dec.precision, device)  # what bleu_on decodes in
    kind = "greedy, tokenized lowercased" if d.lowercase else "greedy"
    print(f"validation BLEU ({kind}): {json.dumps(val)} -> testing '{chosen}' with beam {dec.beam}", file=sys.stderr)
    results = {"model": chosen, "step": step, "val_bleu_greedy": val, "train_minutes": train_seconds / 60,
               "parameters": count_parameters(model), "device": str(device), "decode_precision": precision,
               "tests": {}}
    (run_dir / "hyps").mkdir(exist_ok=True)
    for split in [d.valid_split, *dp.load_meta(prepared)["test_splits"]]:
        scores, hyps = bleu_on(model, tokenizer, prepared, split, cfg, device, beam=dec.beam, progress=True)
        write_text(run_dir / "hyps" / f"{split}.{d.tgt_lang}", "".join(clean(h) + "\n" for h in hyps))
        results["tests"][split] = scores
    write_text(run_dir / "results.json", json.dumps(results, indent=2))
    print(f"\n{d.src_lang}->{d.tgt_lang}, {chosen} weights, step {step}, {train_seconds / 60:.1f} min of training, "
          f"beam {dec.beam}, len_penalty {dec.len_penalty}, decode precision {precision}")
    print(f"{'split':<20} {'BLEU':>6} {'chrF':>6} {'tok.lc BLEU':>12}")
    for split, s in results["tests"].items():
        print(f"{split:<20} {s['bleu']:6.2f} {s['chrf']:6.2f} {s['bleu_tok_lc']:12.2f}")
    print(f"sacreBLEU signature: {next(iter(results['tests'].values()))['signature']}")
    print(f"results: {run_dir / 'results.json'}")
    plot_curves(run_dir)
    return results


def plot_curves(run_dir: Path) -> None:
    """Training curves from metrics.jsonl, written to curves.png."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return
    from matplotlib.figure import Figure  # the object API renders without pyplot's global backend state

    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(14, 4))
    axes = fig.subplots(1, 3)
    axes[0].plot(steps, [r["train_loss"] for r in rows], label="train (smoothed NLL)")
    axes[0].plot(steps, [r["val_loss"] for r in rows], label="validation NLL")
    if all("ema_val_loss" in r for r in rows):
        axes[0].plot(steps, [r["ema_val_loss"] for r in rows], label="validation NLL, weight average")
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
