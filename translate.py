"""Translate with a trained Transformer: batched beam search with a KV cache, BLEU, attention heatmaps.

Decoding follows the paper §6.1: beam size 4, length penalty alpha = 0.6 and a maximum output length of
input length + 50. The search functions below are the one implementation shared by this command line and by
train_transformer.py (validation BLEU with greedy search, test BLEU with beam search).

Conventions (data_preparation.py contract): token ids pad=0, unk=1, bos=2, eos=3 for every tokenizer; a source
sequence is its tokens + [eos]; a hypothesis is returned as its tokens without bos and without the final eos.

Policies, in one place:
- Maximum output length per sentence: int(max_len_a * src_len + max_len_b) tokens before the eos, where
  src_len counts the source's real tokens (its eos included); at that length eos is forced. It is also capped
  at the model's max_positions - 1 so decoding stays bounded on absurd inputs.
- Source lines longer than the model's max_positions tokens (or `max_src_len`) are truncated to their first
  tokens (plus eos) with a warning on stderr: one output line per input line, never a crash.
- Empty or whitespace-only lines give an empty translation without running the model.
- Every character is passed to the tokenizer as is (control characters, emoji, any script); a translation
  that decodes to a line break of any kind (\r, \v, \f, U+0085, U+2028...) has it replaced by a space.
- pad and bos are never generated (their log-probabilities are set to -inf, without renormalising).
- Beam stopping rule (fairseq's): a sentence is done as soon as `beam` finished hypotheses are collected, or
  when its maximum length is reached. Only eos candidates ranked within the top `beam` of a step are kept, and
  the next beams are the best `beam` non-eos candidates among the top 2*beam, so finished hypotheses never
  starve the beam. Scores are sum of log-probabilities (eos included) / lp(Y), with GNMT's length penalty
  lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016), |Y| counting the eos.
- A run directory is read as checkpoint_avg.pt > checkpoint_best.pt > checkpoint_last.pt: the trainer keeps
  the averaged weights only when they beat the best single checkpoint on validation BLEU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import re
import sys
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer
from tqdm import tqdm

import data_preparation as dp
from config import UserError, cli_main, config_from_dict
from transformer_model import Transformer

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3  # fixed for all tokenizers by the data contract
NEG_INF = float("-inf")
CHECKPOINT_ORDER = ("checkpoint_avg.pt", "checkpoint_best.pt", "checkpoint_last.pt")  # tried in this order


# ---------------------------------------------------------------- decoding core (shared with the trainer)


def max_lengths(model, src_mask: torch.Tensor, max_len_a: float, max_len_b: float) -> torch.Tensor:
    """(B,) longest output per sentence: int(a * src_len + b) (§6.1: src_len + 50), capped by positions."""
    src_len = src_mask.sum(dim=1).double()  # (B,) real source tokens, eos included
    lengths = (max_len_a * src_len + max_len_b).floor().long().clamp(min=0)
    limit = getattr(getattr(model, "cfg", None), "max_positions", None)
    return lengths.clamp(max=limit - 1) if limit else lengths


def next_log_probs(model, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache):
    """Log-probabilities (N,V) in fp32 of the token after each prefix in tokens (N,t+1), bos first."""
    if cache is not None:
        h = model.decode(tokens[:, -1:], memory, src_mask, cache)  # (N,1,D): only the newest token is fed
    else:
        h = model.decode(tokens, memory, src_mask)  # (N,t+1,D): the whole prefix again, no cache
    lprobs = model.generator(h[:, -1]).float().log_softmax(dim=-1)  # (N,V)
    lprobs[:, PAD_ID] = NEG_INF  # never emit padding or a second bos
    lprobs[:, BOS_ID] = NEG_INF
    return lprobs


def greedy_search(model, src: torch.Tensor, max_len_a: float, max_len_b: float,
                  use_cache: bool = True) -> list[list[int]]:
    """Most probable next token at each step; src (B,S) padded with pad -> B token lists (no bos/eos)."""
    if src.size(0) == 0:
        return []
    memory, src_mask = model.encode(src)  # (B,S,D), (B,S)
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)  # (B,)
    cache = model.new_cache() if use_cache else None
    sent = torch.arange(src.size(0), device=src.device)  # original index of each still-running sentence
    tokens = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)  # (N,1)
    out: list[list[int]] = [[] for _ in range(src.size(0))]
    t = 0
    while sent.numel() > 0:
        nxt = next_log_probs(model, tokens, memory, src_mask, cache).argmax(dim=-1)  # (N,)
        nxt = nxt.masked_fill(limits == t, EOS_ID)  # at the maximum length, end the sentence
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)  # (N,t+2)
        done = nxt == EOS_ID
        if done.any():
            ended = done.nonzero().squeeze(1)
            for i, seq in zip(sent[ended].tolist(), tokens[ended, 1:-1].tolist(), strict=True):
                out[i] = seq
            keep = (~done).nonzero().squeeze(1)  # drop finished sentences from the batch
            sent, limits, tokens = sent[keep], limits[keep], tokens[keep]
            memory, src_mask = memory[keep], src_mask[keep]
            if cache is not None and keep.numel() > 0:
                cache.reorder(keep)
        t += 1
    return out


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016), the one the paper's §6.1 tunes."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(model, src: torch.Tensor, beam: int, len_penalty: float, max_len_a: float, max_len_b: float,
                nbest: int = 1, use_cache: bool = True) -> list[list[tuple[list[int], float]]]:
    """Batched beam search over B sentences x `beam` rows; per sentence the nbest (tokens, score), best first.

    Sentences that are done leave the batch (memory, mask and cache rows are index-selected away), so a
    long sentence does not keep short ones' beams busy. The stopping rule is in the module docstring.
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest={nbest} must be between 1 and beam={beam}")
    k, dev = beam, src.device
    if src.size(0) == 0:
        return []
    memory, src_mask = model.encode(src)  # (B,S,D), (B,S)
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)  # (B,)
    memory = memory.repeat_interleave(k, dim=0)  # (B,S,D) -> (B*k,S,D): row i*k+j is beam j of sentence i
    src_mask = src_mask.repeat_interleave(k, dim=0)  # (B,S) -> (B*k,S)
    cache = model.new_cache() if use_cache else None
    sent = torch.arange(src.size(0), device=dev)  # original index of each active sentence, (N,)
    tokens = torch.full((src.size(0) * k, 1), BOS_ID, dtype=torch.long, device=dev)  # (N*k,t+1) prefixes
    scores = torch.full((src.size(0), k), NEG_INF, device=dev)  # (N,k) summed log-probs of the beams
    scores[:, 0] = 0.0  # all beams start identical: expand only beam 0 at the first step
    n_done = torch.zeros(src.size(0), dtype=torch.long, device=dev)  # finished hypotheses per sentence
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(src.size(0))]
    rank = torch.arange(2 * k, device=dev)  # candidate rank within a sentence, best first
    t = 0
    while True:
        n = sent.numel()
        lprobs = next_log_probs(model, tokens, memory, src_mask, cache)  # (N*k,V)
        at_max = limits == t  # (N,) sentences whose hypotheses must end now
        if at_max.any():
            force = at_max.repeat_interleave(k)  # (N*k,)
            eos = lprobs[force, EOS_ID]
            lprobs[force] = NEG_INF
            lprobs[force, EOS_ID] = eos
        # A sentence's 2k best continuations are among the 2k best tokens of each of its beams: select those
        # first, so the beam scores are added to (N*k,2k) numbers instead of the whole (N*k,V) table.
        row_lp, row_tok = lprobs.topk(2 * k, dim=1)  # (N*k,2k)
        cand = (scores.view(-1, 1) + row_lp).view(n, k * 2 * k)  # (N*k,1)+(N*k,2k) -> (N,k*2k)
        cand_scores, cand_idx = cand.topk(2 * k, dim=1)  # (N,2k) best first
        cand_beam = cand_idx // (2 * k)  # (N,2k) which beam each candidate extends
        cand_tok = row_tok.view(n, k * 2 * k).gather(1, cand_idx)  # (N,2k) and with which token
        is_eos = cand_tok == EOS_ID
        # Finish eos candidates that rank within the top k (a lower one would not have survived as a beam),
        # in rank order until the sentence holds k finished hypotheses.
        take = is_eos & (rank < k) & cand_scores.isfinite()  # (N,2k)
        take &= n_done[:, None] + take.cumsum(dim=1) <= k
        if take.any():
            where = take.nonzero()  # (F,2) (sentence, candidate) pairs, row-major like boolean indexing
            rows = where[:, 0] * k + cand_beam[take]  # (F,) the beam row each finished hypothesis extends
            lp = length_penalty(t + 1, len_penalty)  # every hypothesis finishing now has t tokens + eos
            for i, seq, s in zip(sent[where[:, 0]].tolist(), tokens[rows, 1:].tolist(),
                                 cand_scores[take].tolist(), strict=True):
                finished[i].append((seq, s / lp))
            n_done += take.sum(dim=1)
        # The next beams: the k best candidates that do not end.
        scores, pick = cand_scores.masked_fill(is_eos, NEG_INF).topk(k, dim=1)  # (N,k)
        rows = torch.arange(n, device=dev)[:, None] * k + cand_beam.gather(1, pick)  # (N,k) rows to extend
        nxt = cand_tok.gather(1, pick)  # (N,k)
        done = (n_done >= k) | at_max  # (N,)
        if done.any():
            keep = (~done).nonzero().squeeze(1)  # (N',)
            if keep.numel() == 0:
                break
            sent, limits, n_done = sent[keep], limits[keep], n_done[keep]
            rows, nxt, scores = rows[keep], nxt[keep], scores[keep]
            same = (keep[:, None] * k + torch.arange(k, device=dev)).view(-1)  # (N'*k,) rows of kept ones
            memory, src_mask = memory[same], src_mask[same]  # identical within a sentence: no beam reorder
        rows = rows.view(-1)  # (N',k) -> (N'*k,)
        if cache is not None:
            cache.reorder(rows)  # beam reorder and dropping finished sentences in one index_select
        tokens = torch.cat([tokens[rows], nxt.view(-1, 1)], dim=1)  # (N'*k,t+2)
        t += 1
    results = []
    for hyps in finished:
        hyps = sorted(hyps, key=lambda h: -h[1]) or [([], NEG_INF)]  # stable: ties keep their rank order
        results.append(hyps[:nbest])
    return results


# ---------------------------------------------------------------- text in, text out


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length (longest first), in batches whose padded size len*count <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)  # the first index of a batch is its longest
        else:
            batches.append([i])
    return batches


def pad_batch(seqs: list[list[int]]) -> torch.Tensor:
    """(B,S) LongTensor of the sequences, right-padded with pad."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def autocast(device: torch.device, precision: str):
    """bf16/fp16 autocast for decoding; fp32 runs as is."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise UserError(f"precision '{precision}' is unknown; use fp32, bf16 or fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def source_limit(model, max_src_len: int | None) -> int | None:
    """Longest source (eos included) we feed the model: max_src_len, else the model's max_positions."""
    return max_src_len or getattr(getattr(model, "cfg", None), "max_positions", None)


def encode_sources(tokenizer, texts: list[str], limit: int | None,
                   first_line: int = 1) -> list[list[int] | None]:
    """Token ids per line (None for an empty line); over-long lines are truncated with a warning on stderr."""
    out: list[list[int] | None] = []
    for i, text in enumerate(texts):
        if not text.strip():
            out.append(None)
            continue
        ids = tokenizer.encode_src(text)
        if limit and len(ids) > limit:
            print(f"warning: input line {first_line + i} has {len(ids)} source tokens, more than the limit "
                  f"of {limit}; translating its first {limit - 1} tokens only", file=sys.stderr)
            ids = ids[:limit - 1] + [EOS_ID]
        out.append(ids)
    return out


def search_texts(model, tokenizer, texts: list[str], *, beam: int = 4, len_penalty: float = 0.6,
                 max_len_a: float = 1.0, max_len_b: float = 50, batch_tokens: int = 4000, nbest: int = 1,
                 use_cache: bool = True, greedy_ok: bool = True, device=None, precision: str = "fp32",
                 progress: bool = False, max_src_len: int | None = None, first_line: int = 1,
                 ) -> list[list[tuple[list[int], float]]]:
    """Token-level n-best lists for raw lines, in input order (length-sorted batches inside)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    sources = encode_sources(tokenizer, texts, source_limit(model, max_src_len), first_line)
    results: list[list[tuple[list[int], float]]] = [[([], 0.0)] for _ in texts]  # empty lines stay empty
    real = [i for i, s in enumerate(sources) if s is not None]
    batches = [[real[j] for j in b] for b in length_batches([len(sources[i]) for i in real], batch_tokens)]
    was_training = model.training
    model.eval()  # no dropout while decoding
    bar = tqdm(total=len(real), unit="sent", file=sys.stderr, disable=not progress or len(real) <= 1)
    try:
        with torch.inference_mode(), autocast(device, precision):
            for batch in batches:
                src = pad_batch([sources[i] for i in batch]).to(device)  # (B,S)
                if beam == 1 and greedy_ok:
                    seqs = greedy_search(model, src, max_len_a, max_len_b, use_cache)
                    hyps = [[(seq, math.nan)] for seq in seqs]  # greedy search keeps no scores
                else:
                    hyps = beam_search(model, src, beam, len_penalty, max_len_a, max_len_b, nbest, use_cache)
                for i, h in zip(batch, hyps, strict=True):
                    results[i] = h
                bar.update(len(batch))
    finally:
        bar.close()
        model.train(was_training)
    return results


def translate_texts(model, tokenizer, texts: list[str], **options) -> list[str]:
    """Best translation per line as detokenized text, in input order; beam == 1 is greedy search.

    options: beam, len_penalty, max_len_a, max_len_b, batch_tokens, use_cache, device, precision, progress,
    max_src_len, first_line (see search_texts).
    """
    found = search_texts(model, tokenizer, texts, **options)
    return [tokenizer.decode_tgt(h[0][0]) if h[0][0] else "" for h in found]


def translate_nbest(model, tokenizer, texts: list[str], nbest: int,
                    **options) -> list[list[tuple[str, float]]]:
    """The nbest (text, score) per line from beam search, best first; an empty line gives [("", 0.0)]."""
    found = search_texts(model, tokenizer, texts, nbest=nbest, greedy_ok=False, **options)
    return [[(tokenizer.decode_tgt(seq) if seq else "", s) for seq, s in h] for h in found]


# ---------------------------------------------------------------- scores


def score(hyps: list[str], refs: list[str], tgt_lang: str) -> dict:
    """Cased detokenized sacreBLEU and chrF, plus tokenized lowercased BLEU as Multi30k papers report it."""
    if len(hyps) != len(refs):
        raise UserError(f"{len(hyps)} translations but {len(refs)} reference lines: "
                        "give one reference line per input line")
    if not hyps:
        raise UserError("nothing to score: the input has no lines")
    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    # Literature BLEU on Multi30k: Moses-tokenize both sides, lowercase, then plain n-gram matching.
    moses = MosesTokenizer(lang=tgt_lang)
    tok = [moses.tokenize(h, escape=False, return_str=True) for h in hyps]
    tok_refs = [moses.tokenize(r, escape=False, return_str=True) for r in refs]
    tok_bleu = BLEU(tokenize="none", lowercase=True, force=True)
    tl = tok_bleu.corpus_score(tok, [tok_refs])
    scores = {"bleu": float(b.score), "chrf": float(c.score), "bleu_tok_lc": float(tl.score),
              "signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
              "bleu_tok_lc_signature": f"moses-tok:{tgt_lang}|{tok_bleu.get_signature()}",
              "sentences": len(hyps)}
    if tgt_lang == "de":  # the paper's En-De figure (§6.1): tokenized, compound-split, cased
        scores["bleu_compound_split"] = compound_split_bleu(hyps, refs)
    return scores


COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(tokenized: str) -> str:
    """'Arbeits-Platz' -> 'Arbeits ##AT##-##AT## Platz' (the perl s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g)."""
    return COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def compound_split_bleu(hyps: list[str], refs: list[str], lang: str = "de") -> float:
    """BLEU as tensor2tensor's get_ende_bleu.sh and fairseq's compound_split_bleu.sh compute it: Moses-tokenize
    (with escaping), split hyphenated compounds "a-b" -> "a ##AT##-##AT## b", case-sensitive, no more tokenizing.
    It runs 0.5-1 BLEU above sacreBLEU (fairseq: 29.3 compound-split = 28.6 sacreBLEU for one model)."""
    moses = MosesTokenizer(lang=lang)
    prepare = lambda line: split_compounds(moses.tokenize(line, return_str=True))  # noqa: E731
    return float(BLEU(tokenize="none", force=True).corpus_score([prepare(h) for h in hyps],
                                                                 [[prepare(r) for r in refs]]).score)


def format_scores(scores: dict) -> str:
    """A small table of score()'s result."""
    rows = [("BLEU (cased, detokenized)", scores["bleu"], scores["signature"]),
            ("chrF", scores["chrf"], scores["chrf_signature"]),
            ("BLEU (tokenized, lowercased)", scores["bleu_tok_lc"], scores["bleu_tok_lc_signature"])]
    if "bleu_compound_split" in scores:
        rows.append(("BLEU (tok., compound-split)", scores["bleu_compound_split"], "moses-tok:de|##AT##|case:mixed"))
    lines = [f"{'metric':<30} {'score':>6}  signature ({scores['sentences']} sentences)"]
    lines += [f"{name:<30} {value:6.2f}  {sig}" for name, value, sig in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- checkpoints


def find_checkpoint(path) -> Path:
    """A .pt file as given, or in a run directory the first of checkpoint_avg.pt, _best.pt, _last.pt."""
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


def one_line(e: Exception, limit: int = 300) -> str:
    """An exception message squeezed onto one line (state-dict errors span many)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def tokenizer_fingerprint(folder) -> str:
    """sha256 of a saved tokenizer (its settings and files): the trainer stores it in every checkpoint, so a
    tokenizer folder from another run is caught even when its vocabulary has the same size."""
    folder = Path(folder)
    try:
        info = json.loads((folder / "tokenizer.json").read_text("utf-8"))
        digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode())
        for name in info["files"]:
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot load the tokenizer in {folder}: {one_line(e)}") from None
    return digest.hexdigest()


def load_checkpoint(path, device="cpu"):
    """(model, tokenizer, cfg) from a run directory or a checkpoint file whose folder holds tokenizer/."""
    file = find_checkpoint(path)
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)  # tensors and plain values only
    except OSError as e:
        raise UserError(f"cannot read checkpoint {file}: {e.strerror or one_line(e)}") from None
    except Exception as e:  # torch raises many types for truncated or foreign files
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:  # the safe loader met a Python object that is not a tensor or a plain value
            raise UserError(f"refusing to load {file}: it holds a Python object ({refused.group(1)}) that "
                            "the safe torch.load(weights_only=True) does not accept") from None
        raise UserError(f"cannot read checkpoint {file}: truncated, corrupt or not a checkpoint "
                        f"({one_line(e, 120)})") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("model"), dict)
            and isinstance(ckpt.get("config"), dict)):
        raise UserError(f"{file} is not a checkpoint of this project (no 'model' and 'config' entries)")
    try:
        cfg = config_from_dict(ckpt["config"])
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
    tok_dir = file.parent / "tokenizer"
    if not tok_dir.is_dir():
        raise UserError(f"tokenizer folder not found: {tok_dir} (a run directory keeps tokenizer/ next to "
                        "its checkpoints)")
    try:
        tokenizer = dp.load_tokenizer(tok_dir)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {tok_dir}: {one_line(e)}") from None
    expected = ckpt.get("tokenizer_sha256")  # absent in checkpoints written before it was recorded
    if expected is not None and tokenizer_fingerprint(tok_dir) != expected:
        raise UserError(f"the tokenizer in {tok_dir} is not the one {file.name} was trained with (another run's, "
                        "or altered); copy that run's tokenizer/ folder next to the checkpoint")
    m = cfg.model
    if (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size) != (m.src_vocab_size, m.tgt_vocab_size):
        raise UserError(f"tokenizer in {tok_dir} has vocab sizes {tokenizer.src_vocab_size}/"
                        f"{tokenizer.tgt_vocab_size} but the model expects {m.src_vocab_size}/"
                        f"{m.tgt_vocab_size}: it belongs to another run")
    return model.to(device).eval(), tokenizer, cfg


# ---------------------------------------------------------------- attention heatmap


def fit_labels(labels: list[str], n: int) -> list[str]:
    """Exactly n tick labels: cut, or padded with '?' if the tokenizer's pieces disagree with the ids."""
    return (list(labels) + ["?"] * n)[:n]


def plot_attention(model, tokenizer, text: str, tokens: list[int], out_path, layer: int | None = None,
                   head: int | None = None, all_heads: bool = False, max_src_len: int | None = None) -> Path:
    """Cross-attention heatmap (source pieces on x, output pieces on y) from the explicit attention path.

    layer and head count from 1 (default: the last layer, mean over heads); all_heads: a grid of every head.
    """
    from matplotlib.figure import Figure  # the object API renders without pyplot's global backend state

    device = next(model.parameters()).device
    (src_ids,) = encode_sources(tokenizer, [text], source_limit(model, max_src_len))
    src = torch.tensor([src_ids], device=device)  # (1,S)
    tgt_in = torch.tensor([[BOS_ID, *tokens]], device=device)  # (1,T): row i is the step that outputs token i
    model.eval()
    with torch.inference_mode():
        _, weights = model(src, tgt_in, need_weights=True)
    cross = weights["cross"]  # per decoder layer (1,H,T,S)
    n_layers, n_heads = len(cross), cross[0].size(1)
    layer = n_layers if layer is None else layer
    if not 1 <= layer <= n_layers:
        raise UserError(f"--layer {layer} is out of range: the decoder has layers 1..{n_layers}")
    if head is not None and not 1 <= head <= n_heads:
        raise UserError(f"--head {head} is out of range: the model has heads 1..{n_heads}")
    attn = cross[layer - 1][0].float().cpu()  # (H,T,S)
    pieces = tokenizer.src_pieces(text)  # ends with the eos piece, as the encoder reads it
    x_labels = fit_labels(pieces if len(pieces) <= len(src_ids) else pieces[:len(src_ids) - 1] + pieces[-1:],
                          attn.size(2))
    y_labels = fit_labels(tokenizer.tgt_pieces([*tokens, EOS_ID]), attn.size(1))
    if all_heads:
        panels = [(attn[h], f"head {h + 1}") for h in range(n_heads)]
    elif head is not None:
        panels = [(attn[head - 1], f"head {head}")]
    else:
        panels = [(attn.mean(dim=0), f"mean of {n_heads} heads")]
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    cell = 0.32  # inches per token keeps labels legible at any sentence length
    width, height = cols * (cell * attn.size(2) + 1.8), rows * (cell * attn.size(1) + 1.6)
    fig = Figure(figsize=(max(width, 5), max(height, 3.5)), layout="tight")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(w.max()) for w, _ in panels)  # one colour scale, so heads can be compared
    for ax, (w, title) in zip(axes.flat, panels, strict=False):
        im = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(x_labels)), x_labels, rotation=60, ha="right", rotation_mode="anchor",
                      fontsize=9)
        ax.set_yticks(range(len(y_labels)), y_labels, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("source")
        ax.set_ylabel("output")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"cross-attention, decoder layer {layer} of {n_layers}", fontsize=11)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    return out_path


# ---------------------------------------------------------------- command line

EXAMPLES = """examples:
  python translate.py --checkpoint runs/multi30k_en_de "A man is riding a bike." "Two dogs play."
  echo "A girl in a red coat." | python translate.py --checkpoint runs/multi30k_en_de
  python translate.py --checkpoint runs/multi30k_en_de --input in.en --output out.de --beam 5
  python translate.py --checkpoint runs/multi30k_en_de --reference test_2016_flickr --output hyps.de --json
  python translate.py --checkpoint runs/multi30k_en_de/checkpoint_last.pt --nbest 3 "A dog runs."
  python translate.py --checkpoint runs/multi30k_en_de "A dog runs." --plot-attention attn.png --all-heads

--checkpoint takes a run directory (checkpoint_avg.pt, else checkpoint_best.pt, else checkpoint_last.pt) or
a .pt file whose folder holds tokenizer/. Without sentences or --input, lines are read from standard input
and each translation is printed as soon as it is ready (one output line per input line; an empty line gives
an empty line). With --nbest N each input gives N lines "INDEX<TAB>SCORE<TAB>TRANSLATION", best first, INDEX
counting input lines from 0. With --reference the scores follow the translations on standard output (a table,
or one JSON line with --json); use --output to keep the translations out of the way. Lines longer than the
model's max_positions tokens are truncated with a warning. --output is written to a temporary file renamed at
the end, so a failed run leaves an earlier file of that name untouched. --debug shows the traceback of an error."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Translate sentences with a trained Transformer (beam search, BLEU, attention plots).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="*", help="sentences to translate, one output line each")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_FILE", help="run directory or .pt file")
    p.add_argument("--input", metavar="FILE", help="translate this UTF-8 text file, one sentence per line")
    p.add_argument("--output", metavar="FILE", help="write translations here instead of standard output")
    p.add_argument("--reference", metavar="FILE_OR_SPLIT",
                   help="score against this file, or a split of the checkpoint's dataset (e.g. "
                        "test_2016_flickr: its source is translated when no sentence or --input is given)")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON line")
    g = p.add_argument_group("search (defaults: the checkpoint's decode section)")
    g.add_argument("--beam", type=int, help="beam size; 1 = greedy search (paper: 4)")
    g.add_argument("--len-penalty", type=float, help="alpha of the penalty ((5+|Y|)/6)^alpha (paper: 0.6)")
    g.add_argument("--max-len-a", type=float, help="maximum output length is a * source length + b")
    g.add_argument("--max-len-b", type=int, help="see --max-len-a (paper: a=1, b=50)")
    g.add_argument("--nbest", type=int, default=1, help="print the N best hypotheses per input (N <= beam)")
    g.add_argument("--batch-tokens", type=int, help="source tokens (padding included) per batch")
    g.add_argument("--max-src-len", type=int, help="truncate longer sources (default: max_positions)")
    g.add_argument("--no-cache", action="store_true", help="recompute the prefix every step (slow)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; 1 is often "
                   "fastest for small models on a busy machine)")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 runs under autocast")
    a = p.add_argument_group("attention plot")
    a.add_argument("--plot-attention", metavar="OUT.png", help="cross-attention heatmap of the sentence")
    a.add_argument("--layer", type=int, help="decoder layer, from 1 (default: the last)")
    a.add_argument("--head", type=int, help="one head, from 1 (default: the mean over heads)")
    a.add_argument("--all-heads", action="store_true", help="a grid with every head of the layer")
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device '{name}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device asks for CUDA but no GPU is visible; use --device cpu")
    return device


def read_lines(path) -> list[str]:
    """Lines of a UTF-8 file split on \\n only (a stray \\r or form feed stays inside its line); \\r\\n ok."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"file not found: {p}")
    if p.is_dir():
        raise UserError(f"{p} is a directory, expected a text file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{p} is not UTF-8 text (bad byte on line {line}); convert it (e.g. iconv)") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return [line.removesuffix("\r") for line in lines]


LINE_BREAKS = re.compile("[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")  # all that str.splitlines() splits on


def output_path(path, input_path, checkpoint: Path) -> Path:
    """--output, checked before any work: a file in an existing folder, never the input or a checkpoint."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--output {p} is a directory, expected a file path")
    if not p.parent.is_dir():
        raise UserError(f"--output {p}: the folder {p.parent} does not exist")
    if p.exists() and (p.resolve() == checkpoint.resolve() or p.suffix == ".pt"):
        raise UserError(f"--output {p} is a checkpoint file: refusing to write translations over it")
    if p.exists() and input_path and p.resolve() == Path(input_path).resolve():
        raise UserError(f"--output {p} is also the --input file: write the translations to another file")
    return p


def clean(text: str) -> str:
    """One output line per input line, whatever the tokenizer decodes (and however the reader splits lines)."""
    return LINE_BREAKS.sub(" ", text)


def format_output(index: int, hyps, nbest: int) -> list[str]:
    if nbest == 1:
        return [clean(hyps)]
    return [f"{index}\t{s:.4f}\t{clean(h)}" for h, s in hyps]


def references(spec: str, cfg) -> tuple[list[str], list[str] | None]:
    """(reference lines, source lines or None) for --reference: an existing file, else a split name."""
    if Path(spec).exists():
        return read_lines(spec), None
    d = cfg.data
    tests = [Path(p).name for p in d.test_prefixes] if d.dataset == "files" else d.test_splits
    known = [d.valid_split, *tests]
    if spec not in known:
        raise UserError(f"--reference {spec}: no such file, and not a split of this checkpoint's dataset "
                        f"({', '.join(known)})")
    with contextlib.redirect_stdout(sys.stderr):  # its summary must not mix with the translations
        prepared = dp.prepare(d)  # cached: reuses the prepared data of the training run when it is there
    return dp.read_raw(prepared, spec, d.tgt_lang), dp.read_raw(prepared, spec, d.src_lang)


def stdin_lines():
    """Standard input line by line as it arrives, split on \\n only, endings removed; prompt on a terminal."""
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="\n")  # no universal-newline split
    interactive = sys.stdin.isatty()
    number = 1
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = stdin.readline()
        except UnicodeDecodeError:
            raise UserError(f"standard input is not UTF-8 text (line {number})") from None
        if line == "":
            return
        yield line.removesuffix("\n").removesuffix("\r")
        number += 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.text and args.input:
        raise UserError("give sentences as arguments or --input FILE, not both")
    if args.plot_attention and len(args.text) != 1:
        raise UserError("--plot-attention needs exactly one sentence given as an argument")
    device = resolve_device(args.device)
    output = output_path(args.output, args.input, find_checkpoint(args.checkpoint)) if args.output else None
    if args.plot_attention and Path(args.plot_attention).is_dir():
        raise UserError(f"--plot-attention {args.plot_attention} is a directory, expected an image file path")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    model, tokenizer, cfg = load_checkpoint(args.checkpoint, device)
    dec = cfg.decode
    pick = {name: dec_value if arg is None else arg for name, arg, dec_value in [
        ("beam", args.beam, dec.beam), ("len_penalty", args.len_penalty, dec.len_penalty),
        ("max_len_a", args.max_len_a, dec.max_len_a), ("max_len_b", args.max_len_b, dec.max_len_b),
        ("batch_tokens", args.batch_tokens, dec.batch_tokens)]}
    opts = dict(pick, use_cache=not args.no_cache, device=device, precision=args.precision,
                max_src_len=args.max_src_len)
    checks = [(opts["beam"] >= 1, "--beam must be >= 1"),
              (1 <= args.nbest <= opts["beam"], f"--nbest must be between 1 and the beam ({opts['beam']})"),
              (opts["batch_tokens"] >= 1, "--batch-tokens must be >= 1"),
              (opts["max_len_a"] >= 0 and opts["max_len_b"] >= 0, "--max-len-a and --max-len-b must be >= 0"),
              (args.max_src_len is None or args.max_src_len >= 2, "--max-src-len must be >= 2")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    nbest = args.nbest

    def run(lines: list[str], progress: bool, first_line: int = 1) -> list:
        more = dict(opts, progress=progress, first_line=first_line)
        if nbest == 1:
            return translate_texts(model, tokenizer, lines, **more)
        return translate_nbest(model, tokenizer, lines, nbest, **more)

    refs, sources = references(args.reference, cfg) if args.reference else (None, None)
    if args.text:
        sources = args.text
    elif args.input:
        sources = read_lines(args.input)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")
    tmp = output.with_name(f"{output.name}.tmp{os.getpid()}") if output else None
    out = open(tmp, "w", encoding="utf-8", newline="\n") if output else sys.stdout
    best: list[str] = []  # the best translation per line, for scoring
    complete = False
    try:
        if sources is not None:  # a known list: batched by length, progress bar for files and splits
            for i, hyps in enumerate(run(sources, progress=not args.text)):
                out.write("".join(line + "\n" for line in format_output(i, hyps, nbest)))
                best.append(hyps if nbest == 1 else hyps[0][0])
        else:  # standard input: translate and print each line as it arrives
            for i, line in enumerate(stdin_lines()):
                (hyps,) = run([line], progress=False, first_line=i + 1)
                out.write("".join(text + "\n" for text in format_output(i, hyps, nbest)))
                out.flush()
                best.append(hyps if nbest == 1 else hyps[0][0])
        complete = True
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly, like other command-line tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if out is not sys.stdout:
            out.close()
            if complete:
                os.replace(tmp, output)
            else:
                tmp.unlink(missing_ok=True)
    sys.stdout.flush()
    if args.plot_attention:
        if not sources[0].strip():
            raise UserError("--plot-attention: the sentence is empty, nothing to plot")
        (found,) = search_texts(model, tokenizer, sources[:1], **opts)  # the search behind the output
        path = plot_attention(model, tokenizer, sources[0], found[0][0], args.plot_attention,
                              args.layer, args.head, args.all_heads, args.max_src_len)
        print(f"attention plot: {path}", file=sys.stderr)
    if refs is not None:
        scores = score(best, refs, cfg.data.tgt_lang)
        print(json.dumps(scores) if args.json else format_scores(scores), flush=True)
    return 0


if __name__ == "__main__":
    cli_main(main)
