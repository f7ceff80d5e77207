"""Translate with a CTranslate2 folder written by export.py: our tokenizer, our search rules, CTranslate2's speed.

    engine = ct2_engine.load("exported/en_de", threads=4)
    engine.translate(["A man is riding a bike."], beam=4)  # [[(translation, score)]]: n-best per line
    engine.score(["A man."], ["Ein Mann."])                # [log P(ref | src)], eos included

How translate.py's search maps onto CTranslate2 4.x (read in its src/decoding.cc, then measured):
- Stopping. CTranslate2 keeps 2*beam candidates per step, registers every eos among the top `beam` as a finished
  hypothesis and refills the beam with the next non-eos candidates: fairseq's rule, as ours. With
  length_penalty exactly 0 (and no coverage penalty) a sentence then ends once the best candidate of some step
  was eos and it holds num_hypotheses; with any other value it ends once it holds beam * patience finished
  hypotheses, which is our rule with patience 1. So we never pass 0.
- Length penalty. Ours is GNMT's ((5+|Y|)/6)^alpha, CTranslate2's |Y|^alpha; both only rank finished hypotheses
  (beams follow the raw sums), so the search itself is the same. One difference remains: at its last step ours
  registers eos only until it holds `beam`, CTranslate2 registers them all, keeps the best num_hypotheses (<=
  beam) by its own penalty and may drop one that ours keeps. We pass length_penalty RANK_SHORT_FIRST (-8:
  score * |Y|^8), so the hypotheses it keeps are the earliest-finished ones, as ours keeps them; we ask for all
  `beam`, with return_end_token (so |Y| counts the eos, as ours), undo its division to get the raw sums and rank
  with GNMT. (With CTranslate2's default length_penalty 1 instead, 40-58 of 62 random-model sentences agreed.)
- Maximum length. Ours allows int(a*src_len + b) tokens (capped at max_positions-1), then forces eos;
  CTranslate2 has one max_decoding_length per call and no forced eos. Sentences are grouped by their limit L
  and each group is decoded with max_decoding_length L+1: a hypothesis still running at the last step ends
  with a non-eos token, which is cut off (leaving the L-token prefix ours would end there) and rescored with
  eos appended by score_batch. Greedy search is then exact. Beam search is exact unless the best hypothesis
  reaches the limit: CTranslate2 only keeps the prefixes whose continuation ranks in the top `beam` at that
  last step, while ours ends every live beam with eos, so such sentences can differ.
- Empty outputs: min_decoding_length=0 (CTranslate2's default is 1). pad and bos are suppressed, which masks
  their logits before the softmax, as ours does, so both engines search the same distribution. (Masking after
  the softmax instead shifted scores by log(1 - p(pad) - p(bos)) per step, 0.001-0.005 for the 30-step tiny
  model: enough to swap two candidates 0.0003 apart.) Hypotheses rescored at the limit, and score(), use the
  unmasked log-probabilities, as teacher forcing does: about 0 apart for a trained model.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

import data_preparation as dp
from runtime import UserError, resolve_precision

EXPORT_FILE = "nmt_export.json"
SPECIAL_TOKENS = dict(zip(("pad", "unk", "bos", "eos"), dp.SPECIALS, strict=True))  # ids 0-3, in this order
RANK_SHORT_FIRST = -8.0  # CTranslate2 length_penalty: it keeps the earliest-finished hypotheses (see above)
FORMAT_VERSION = 1
COMPUTE_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}  # ours -> CTranslate2's


def require_ctranslate2():
    """The ctranslate2 module, or a one-line UserError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise UserError("ctranslate2 is not installed: pip install ctranslate2") from None
    return ctranslate2


def gnmt_penalty(length: int, alpha: float) -> float:
    """lp(Y) = ((5 + |Y|) / 6)^alpha with |Y| counting the eos, as translate.length_penalty."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_length(src_len: int, max_len_a: float, max_len_b: float, max_positions: int) -> int:
    """Tokens allowed before eos: int(a * src_len + b), src_len counting the eos, capped at max_positions - 1."""
    return max(0, min(math.floor(max_len_a * src_len + max_len_b), max_positions - 1))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


@dataclass
class Hypothesis:
    """A finished hypothesis: token ids without bos/eos and the sum of log-probabilities, eos included."""

    ids: list[int]
    raw: float


class Ct2Translator:
    """An exported model loaded in a ctranslate2.Translator, with the tokenizer and decode defaults it came with."""

    def __init__(self, translator, tokenizer, info: dict):
        self.translator, self.tokenizer, self.info = translator, tokenizer, info
        self.decode = info["decode"]
        self.max_positions = int(info["model"]["max_positions"])
        self.src_vocab = tokenizer.pieces(list(range(tokenizer.src_vocab_size)), tokenizer.src_lang)
        tgt_vocab = tokenizer.pieces(list(range(tokenizer.tgt_vocab_size)), tokenizer.tgt_lang)
        self.tgt_vocab, self.tgt_index = tgt_vocab, {piece: i for i, piece in enumerate(tgt_vocab)}
        self.eos = SPECIAL_TOKENS["eos"]

    # ------------------------------------------------------------ tokens

    def source_tokens(self, lines: list[str], max_src_len: int | None = None,
                      first_line: int = 1) -> list[list[str]]:
        """Source pieces ending with eos, one tokenizer call for all lines (a call per line costs ~1 ms); lines
        longer than max_src_len (default: max_positions) keep their first tokens, with translate.py's warning
        (first_line: the number of lines[0] in it)."""
        limit = max_src_len or self.max_positions
        encoded = self.tokenizer.encode_lines(lines, self.tokenizer.src_lang) if lines else []
        out = []
        for number, ids in enumerate(encoded, start=first_line):
            ids = [*ids, dp.EOS_ID]
            if len(ids) > limit:
                print(f"warning: input line {number} has {len(ids)} source tokens, more than the limit of "
                      f"{limit}; translating its first {limit - 1} tokens only", file=sys.stderr)
                ids = ids[:limit - 1] + [dp.EOS_ID]
            out.append([self.src_vocab[i] for i in ids])
        return out

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode_tgt(ids) if ids else ""

    # ------------------------------------------------------------ translation

    def translate(self, lines: list[str], beam: int | None = None, nbest: int = 1, len_penalty: float | None = None,
                  max_len_a: float | None = None, max_len_b: float | None = None, batch_tokens: int | None = None,
                  max_src_len: int | None = None, first_line: int = 1) -> list[list[tuple[str, float]]]:
        """The nbest (text, score) per line, best first, in input order; an empty line gives [("", 0.0)].

        Unset options take the export's decode defaults; beam 1 is greedy search. Scores are translate.py's:
        sum of log-probabilities (eos included) / ((5 + |Y|) / 6)^len_penalty. As decoding.beam_search, a line
        with fewer distinct hypotheses than nbest has its list filled with ("", -inf).
        """
        d = self.decode
        beam = d["beam"] if beam is None else beam
        alpha = d["len_penalty"] if len_penalty is None else len_penalty
        a = d["max_len_a"] if max_len_a is None else max_len_a
        b = d["max_len_b"] if max_len_b is None else max_len_b
        batch_tokens = d["batch_tokens"] if batch_tokens is None else batch_tokens
        for ok, message in [(beam >= 1, "beam must be >= 1"), (1 <= nbest <= beam, f"nbest must be 1..beam ({beam})"),
                            (batch_tokens >= 1, "batch_tokens must be >= 1"),
                            (a >= 0 and b >= 0, "max_len_a and max_len_b must be >= 0")]:
            if not ok:
                raise UserError(message)
        results: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in lines]
        encoded = self.source_tokens(lines, max_src_len, first_line)  # blank lines too: warnings count every line
        sources = {i: tokens for i, (line, tokens) in enumerate(zip(lines, encoded, strict=True)) if line.strip()}
        groups: dict[int, list[int]] = defaultdict(list)  # output limit -> line indices: one CT2 call per limit
        for i, tokens in sources.items():
            groups[max_output_length(len(tokens), a, b, self.max_positions)].append(i)
        for limit, indices in sorted(groups.items()):
            found = self._search([sources[i] for i in indices], limit, beam, batch_tokens)
            for i, hyps in zip(indices, found, strict=True):
                scored = [(h.raw / gnmt_penalty(len(h.ids) + 1, alpha), h.ids) for h in hyps]
                scored.sort(key=lambda pair: -pair[0])  # stable: ties keep CTranslate2's order
                filler = [("", -math.inf)] * (nbest - len(scored))
                results[i] = [(self._text(ids), score) for score, ids in scored[:nbest]] + filler
        return results

    def _search(self, sources: list[list[str]], limit: int, beam: int, batch_tokens: int) -> list[list[Hypothesis]]:
        """Beam (or greedy) search of sources that share the output limit; up to `beam` hypotheses each."""
        suppress = [[SPECIAL_TOKENS["pad"]], [SPECIAL_TOKENS["bos"]]]
        out = self.translator.translate_batch(
            sources, beam_size=beam, num_hypotheses=beam, length_penalty=RANK_SHORT_FIRST, patience=1,
            return_scores=True, return_end_token=True, max_decoding_length=limit + 1, min_decoding_length=0,
            max_input_length=0, suppress_sequences=suppress, max_batch_size=batch_tokens, batch_type="tokens")
        found: list[list[Hypothesis]] = []
        capped: list[tuple[int, Hypothesis, list[str]]] = []  # hypotheses cut at the last step, to rescore
        for n, result in enumerate(out):
            hyps, seen = [], set()
            for tokens, score in zip(result.hypotheses, result.scores, strict=True):
                ended = bool(tokens) and tokens[-1] == self.eos
                prefix = tokens[:-1] if ended else tokens[:limit]
                if tuple(prefix) in seen:  # two continuations of one prefix at the last step: one hypothesis
                    continue
                seen.add(tuple(prefix))
                hyp = Hypothesis([self.tgt_index[t] for t in prefix], score * max(len(tokens), 1) ** RANK_SHORT_FIRST)
                if not ended:
                    capped.append((n, hyp, prefix))
                hyps.append(hyp)
            found.append(hyps)
        if capped:  # ours ends these with a forced eos: score exactly that
            rescored = self._log_probs([sources[n] for n, _, _ in capped], [p for _, _, p in capped], batch_tokens)
            for (_, hyp, _), raw in zip(capped, rescored, strict=True):
                hyp.raw = raw
        return found

    # ------------------------------------------------------------ scoring

    def _log_probs(self, sources: list[list[str]], targets: list[list[str]], batch_tokens: int) -> list[float]:
        """Sum of log-probabilities of each target followed by eos (teacher forcing, no masking)."""
        too_long = [i for i, t in enumerate(targets) if len(t) + 1 > self.max_positions]
        if too_long:
            raise UserError(f"reference {too_long[0] + 1} has {len(targets[too_long[0]])} tokens; the model's "
                            f"positions allow at most {self.max_positions - 1}")
        out = self.translator.score_batch(sources, targets, max_batch_size=batch_tokens, batch_type="tokens",
                                          max_input_length=0)
        return [float(sum(r.log_probs)) for r in out]

    def score(self, lines: list[str], refs: list[str], batch_tokens: int | None = None) -> list[float]:
        """Per pair, log P(ref | line): the sum of the reference's token log-probabilities, eos included."""
        if len(lines) != len(refs):
            raise UserError(f"{len(lines)} source lines but {len(refs)} references: give one reference per line")
        if not lines:
            return []
        batch_tokens = self.decode["batch_tokens"] if batch_tokens is None else batch_tokens
        sources = self.source_tokens(lines)
        targets = [[self.tgt_vocab[i] for i in self.tokenizer.encode_tgt(ref)] for ref in refs]
        return self._log_probs(sources, targets, batch_tokens)


def read_info(folder) -> dict:
    """The nmt_export.json of an export.py folder, checked; a one-line UserError when it is not one."""
    info_path = Path(folder) / EXPORT_FILE
    if not info_path.is_file():
        raise UserError(f"{folder} is not an exported model (no {EXPORT_FILE}); create one with export.py")
    try:
        info = json.loads(info_path.read_text("utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {info_path}: {_one_line(e)}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION or info.get("engine") != "ctranslate2":
        raise UserError(f"{info_path} is not a format-{FORMAT_VERSION} CTranslate2 export; export the checkpoint again")
    return info


def compute_type(precision: str | None, info: dict, device: torch.device) -> str:
    """CTranslate2's compute type for one of our precisions (fp32, bf16, fp16, int8, auto).

    None: an export quantized by export.py keeps its type ('default'); a float32 export takes its run's
    decode.precision, as the torch engine does. 'auto' is runtime.resolve_precision's choice, or float32 where
    CTranslate2 has no kernels for it (its CPU build has no bfloat16 even where torch computes bf16 natively)."""
    ct2 = require_ctranslate2()
    if precision is None:
        if info.get("quantization", "float32") != "float32":
            return "default"
        precision = info.get("decode", {}).get("precision", "fp32")  # exports made before decode.precision: fp32
    wanted = COMPUTE_TYPES.get(resolve_precision(precision, device))
    if wanted is None:
        raise UserError(f"precision '{precision}' is unknown for CTranslate2; use {', '.join(COMPUTE_TYPES)} or auto")
    try:
        supported = ct2.get_supported_compute_types(device.type, device.index or 0)
    except RuntimeError as e:  # a CUDA device CTranslate2 cannot use (no driver, an older one)
        raise UserError(f"CTranslate2 cannot use {device}: {_one_line(e)}") from None
    if wanted in supported:
        return wanted
    if precision == "auto":
        return "float32"
    raise UserError(f"CTranslate2 cannot compute in {wanted} on {device.type} here (it offers "
                    f"{', '.join(sorted(supported))}); use another precision")


def load(folder, device: str = "cpu", compute_type: str = "default", threads: int = 0,
         device_index: int = 0) -> Ct2Translator:
    """Load an export.py folder; threads 0 lets CTranslate2 choose, compute_type 'default' keeps the export's."""
    ct2 = require_ctranslate2()
    folder = Path(folder)
    info = read_info(folder)
    tokenizer = dp.load_tokenizer(folder / "tokenizer")
    try:
        translator = ct2.Translator(str(folder), device=device, device_index=device_index,
                                    compute_type=compute_type, intra_threads=threads)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"cannot load the CTranslate2 model in {folder}: {_one_line(e)}") from None
    return Ct2Translator(translator, tokenizer, info)
