"""Decoding: batched greedy and beam search with a KV cache, and raw text in, translated text out.

This is the one implementation shared by translate.py (the command line) and the trainer (validation BLEU
with greedy search, test BLEU with beam search). Decoding follows the paper §6.1: beam size 4, length penalty
alpha = 0.6 and a maximum output length of input length + 50.

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
- pad and bos are never generated: their logits are set to -inf before the softmax (renormalising the rest).
- n-best lists have exactly nbest entries per sentence, best first: the hypotheses finished with eos (at the
  maximum length, every live beam is ended there with its score). Only if the search holds fewer distinct
  hypotheses (a beam wider than the vocabulary allows within a short length bound) is the list filled with
  empty entries scored -inf. An empty source line gives the single entry ([], 0.0).
- Beam stopping rule (fairseq's): a sentence is done as soon as `beam` finished hypotheses are collected, or
  when its maximum length is reached. Only eos candidates ranked within the top `beam` of a step are kept, and
  the next beams are the best `beam` non-eos candidates among the top 2*beam, so finished hypotheses never
  starve the beam. Scores are sum of log-probabilities (eos included) / lp(Y), with GNMT's length penalty
  lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016), |Y| counting the eos.

Shapes: B sentences of a batch, N of them still running, k = beam, t = tokens decoded so far, V vocabulary.
"""

from __future__ import annotations

import math
import re
import sys

import torch
from tqdm import tqdm

from data_preparation import BOS_ID, EOS_ID, PAD_ID
from runtime import autocast

NEG_INF = float("-inf")
LINE_BREAKS = re.compile("[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")  # all that str.splitlines() splits on


# ---------------------------------------------------------------- search


def max_lengths(model, src_mask: torch.Tensor, max_len_a: float, max_len_b: float) -> torch.Tensor:
    """(B,) longest output per sentence: int(a * src_len + b) (§6.1: src_len + 50), capped by positions."""
    src_len = src_mask.sum(dim=1).double()  # (B,) real source tokens, eos included
    limit = getattr(getattr(model, "cfg", None), "max_positions", None)
    cap = limit - 1 if limit else 2**62
    # clamp before the casts: a huge a (1e300) cast to int64 wrapped around, which made the length 0, and a
    # huge integer b (10**30) does not fit a tensor
    lengths = (max_len_a * src_len + min(max_len_b, cap)).floor()
    return lengths.clamp(min=0, max=cap).long()


def next_log_probs(model, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache):
    """Log-probabilities (N,V) in fp32 of the token after each prefix in tokens (N,t+1), bos first."""
    if cache is not None:
        h = model.decode(tokens[:, -1:], memory, src_mask, cache)  # (N,1,D): only the newest token is fed
    else:
        h = model.decode(tokens, memory, src_mask)  # (N,t+1,D): the whole prefix again, no cache
    return emittable_log_probs(model.logits(h[:, -1]))  # (N,V)


def emittable_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax (...,V) in fp32 over the tokens a search may emit: padding and a second bos are masked before
    the softmax, so the other tokens share their mass, as in CTranslate2 (both engines search one distribution)."""
    logits = logits.float()
    logits[..., PAD_ID] = NEG_INF
    logits[..., BOS_ID] = NEG_INF
    return logits.log_softmax(dim=-1)


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


def _force_eos(lprobs: torch.Tensor, at_max: torch.Tensor, k: int) -> None:
    """Sentences at their maximum length (N,) may only end: every token but eos gets -inf in lprobs (N*k,V)."""
    force = at_max.repeat_interleave(k)  # (N*k,)
    eos = lprobs[force, EOS_ID]
    lprobs[force] = NEG_INF
    lprobs[force, EOS_ID] = eos


def _pick(lprobs: torch.Tensor, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2k best continuations per sentence, best first: (scores, beam extended, token), each (N,2k).

    A sentence's 2k best continuations are among the 2k best tokens of each of its beams: select those first,
    so the beam scores (N,k) are added to (N*k,2k) numbers instead of the whole (N*k,V) table."""
    n = scores.size(0)
    per_row = min(2 * k, lprobs.size(1))  # a beam wider than half the vocabulary: every token of each row
    row_lp, row_tok = lprobs.topk(per_row, dim=1)  # (N*k,r)
    cand = (scores.view(-1, 1) + row_lp).view(n, k * per_row)  # (N*k,1)+(N*k,r) -> (N,k*r)
    cand_scores, cand_idx = cand.topk(2 * k, dim=1)  # (N,2k)
    return cand_scores, cand_idx // per_row, row_tok.view(n, k * per_row).gather(1, cand_idx)


def _update_finished(finished: list, sent: torch.Tensor, tokens: torch.Tensor, n_done: torch.Tensor,
                     cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: int, lp: float) -> None:
    """Finish the eos candidates that rank within the top k (a lower one would not have survived as a beam),
    in rank order until the sentence holds k finished hypotheses, with score / lp; counts them in n_done (N,)."""
    cand_scores, cand_beam, cand_tok = cand  # (N,2k) each
    rank = torch.arange(2 * k, device=cand_tok.device)  # candidate rank within a sentence, best first
    take = (cand_tok == EOS_ID) & (rank < k) & cand_scores.isfinite()  # (N,2k)
    take &= n_done[:, None] + take.cumsum(dim=1) <= k
    if not take.any():
        return
    where = take.nonzero()  # (F,2) (sentence, candidate) pairs, row-major like boolean indexing
    rows = where[:, 0] * k + cand_beam[take]  # (F,) the beam row each finished hypothesis extends
    for i, seq, s in zip(sent[where[:, 0]].tolist(), tokens[rows, 1:].tolist(), cand_scores[take].tolist(),
                         strict=True):
        finished[i].append((seq, s / lp))
    n_done += take.sum(dim=1)


def _advance(cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next beams, the k best candidates that do not end: (scores (N,k), rows to extend (N,k), tokens (N,k))."""
    cand_scores, cand_beam, cand_tok = cand
    scores, pick = cand_scores.masked_fill(cand_tok == EOS_ID, NEG_INF).topk(k, dim=1)  # (N,k)
    rows = torch.arange(scores.size(0), device=scores.device)[:, None] * k + cand_beam.gather(1, pick)
    return scores, rows, cand_tok.gather(1, pick)


def beam_search(model, src: torch.Tensor, beam: int, len_penalty: float, max_len_a: float, max_len_b: float,
                nbest: int = 1, use_cache: bool = True) -> list[list[tuple[list[int], float]]]:
    """Batched beam search over B sentences x `beam` rows; per sentence the nbest (tokens, score), best first.

    Each step: log-probabilities of every beam's next token, _force_eos at the maximum length, _pick the 2k
    best candidates, _update_finished with the eos ones, _advance to the k best others. Sentences that are
    done leave the batch (memory, mask and cache rows are index-selected away), so a long sentence does not
    keep short ones' beams busy. The stopping rule is in the module docstring.
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
    sent = torch.arange(src.size(0), device=dev)  # (N,) original index of each active sentence
    tokens = torch.full((src.size(0) * k, 1), BOS_ID, dtype=torch.long, device=dev)  # (N*k,t+1) prefixes
    scores = torch.full((src.size(0), k), NEG_INF, device=dev)  # (N,k) summed log-probs of the beams
    scores[:, 0] = 0.0  # all beams start identical: expand only beam 0 at the first step
    n_done = torch.zeros(src.size(0), dtype=torch.long, device=dev)  # (N,) finished hypotheses per sentence
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(src.size(0))]
    t = 0
    while True:
        lprobs = next_log_probs(model, tokens, memory, src_mask, cache)  # (N*k,V)
        at_max = limits == t  # (N,) sentences whose hypotheses must end now
        if at_max.any():
            _force_eos(lprobs, at_max, k)
        cand = _pick(lprobs, scores, k)
        # every hypothesis finishing now has t tokens + eos
        _update_finished(finished, sent, tokens, n_done, cand, k, length_penalty(t + 1, len_penalty))
        scores, rows, nxt = _advance(cand, k)  # (N,k) each
        done = (n_done >= k) | at_max  # (N,)
        same = None  # rows of the sentences still running, when some ended this step
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
            cache.reorder_beams(rows, same)  # beam reorder and dropping finished sentences in one index_select
        tokens = torch.cat([tokens[rows], nxt.view(-1, 1)], dim=1)  # (N'*k,t+2)
        t += 1
    results = []
    for hyps in finished:
        hyps = sorted(hyps, key=lambda h: -h[1])  # stable: ties keep their rank order
        # Exactly nbest entries: fewer distinct hypotheses exist only when the vocabulary (less pad and bos)
        # is smaller than the beam and the length bound is short; the rest are ([], -inf), no hypothesis.
        results.append((hyps + [([], NEG_INF)] * nbest)[:nbest])
    return results


# ---------------------------------------------------------------- ensembles


class EnsembleCache:
    """One KVCache per member, reordered together."""

    def __init__(self, caches: list):
        self.caches = caches

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reorder(self, index: torch.Tensor) -> None:
        for cache in self.caches:
            cache.reorder(index)

    def reorder_beams(self, rows: torch.Tensor, kept: torch.Tensor | None) -> None:
        for cache in self.caches:
            cache.reorder_beams(rows, kept)


class Ensemble(torch.nn.Module):
    """Models that share one tokenizer, searched as one: the next-token distribution is the mean of the members'
    probabilities (as fairseq's EnsembleModel). Their memories and hidden states travel concatenated along the
    feature dim (B,S,D1+D2+...), so the searches index and reorder them along the batch dim as for one model."""

    def __init__(self, models: list):
        super().__init__()
        self.members = torch.nn.ModuleList(models)
        self.widths = [m.cfg.d_model for m in models]
        self.cfg = min((m.cfg for m in models), key=lambda c: c.max_positions)  # the tightest position limit

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B,S) -> the members' memories side by side (B,S,sum D) and the src_mask (B,S)."""
        encoded = [m.encode(src) for m in self.members]
        return torch.cat([memory for memory, _ in encoded], dim=-1), encoded[0][1]

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([m.new_cache() for m in self.members])

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: EnsembleCache | None = None) -> torch.Tensor:
        """The members' hidden states side by side, (B,T,sum D)."""
        caches = cache.caches if cache is not None else [None] * len(self.members)
        parts = memory.split(self.widths, dim=-1)
        return torch.cat([m.decode(tgt, part, src_mask, c)
                          for m, part, c in zip(self.members, parts, caches, strict=True)], dim=-1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """log of the mean of the members' search distributions (...,V), fp32: normalised, so
        emittable_log_probs returns it as it is."""
        lprobs = [emittable_log_probs(m.logits(part))
                  for m, part in zip(self.members, h.split(self.widths, dim=-1), strict=True)]
        return torch.stack(lprobs).logsumexp(dim=0) - math.log(len(lprobs))


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


def clean(text: str) -> str:
    """One output line per input line, whatever the tokenizer decodes (and however the reader splits lines)."""
    return LINE_BREAKS.sub(" ", text)
