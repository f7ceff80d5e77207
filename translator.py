"""Use a trained model from Python: load a run once, translate lists of sentences, get scores, n-best lists and
cross-attention weights as plain Python values.

    from translator import Translator
    tr = Translator.load("runs/multi30k_en_de")
    (t,) = tr.translate(["A dog runs in the snow."], beam=4, nbest=3, attention=True)
    print(t.text, t.score, t.hypotheses)
    t.attention[-1][0]  # last decoder layer, head 1: rows are output pieces t.tgt_tokens, columns t.src_tokens

The search is decoding.search_texts (length-sorted batches of about batch_tokens source tokens, beam search with
the KV cache, greedy search at beam 1), so results equal translate.py's for the same settings. One lock
serialises model calls: a Translator can be shared between threads (the HTTP server in server.py does).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkpoint import find_checkpoint, load_checkpoint
from config import Config
from data_preparation import BOS_ID, EOS_ID
from decoding import encode_sources, search_texts, source_limit
from runtime import UserError, autocast, resolve_device, resolve_precision

ENGINES = ("torch",)  # "ctranslate2" arrives with ct2_engine.py
PRECISIONS = ("fp32", "bf16", "fp16", "auto")


@dataclass
class Translation:
    """One input sentence's result; score is None for greedy search (beam 1), which keeps no score."""

    text: str  # the best translation, detokenized ("" for an empty input)
    score: float | None  # its length-normalised log-probability (decoding.py's beam score)
    hypotheses: list[tuple[str, float | None]]  # the nbest (text, score), best first; hypotheses[0] is the best
    src_tokens: list[str] | None = None  # source pieces as the encoder reads them, eos last (attention=True)
    tgt_tokens: list[str] | None = None  # output pieces of the best hypothesis, eos last (attention=True)
    attention: list[list[list[list[float]]]] | None = field(default=None, repr=False)  # [layer][head][tgt][src]


def _score(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _fit(labels: list[str], n: int) -> list[str]:
    """Exactly n labels: cut, or padded with '?' if the tokenizer's pieces disagree with the ids."""
    return (list(labels) + ["?"] * n)[:n]


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} must be {bound}")
    return value


def _check_float(name: str, value: object, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number")
    if low is not None and value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return float(value)


class Translator:
    """A loaded model with its tokenizer and decode defaults; translate() is thread-safe."""

    def __init__(self, model, tokenizer, cfg: Config, device: torch.device, precision: str, name: str,
                 batch_tokens: int | None = None):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.device, self.precision, self.name = device, precision, name
        self.engine = "torch"
        self.batch_tokens = _check_int("batch_tokens", cfg.decode.batch_tokens if batch_tokens is None
                                       else batch_tokens, 1)
        self._lock = threading.Lock()  # the model and its KV caches are not safe to run from two threads at once

    @classmethod
    def load(cls, run_dir_or_checkpoint: str | Path, device: str = "auto", precision: str = "fp32",
             engine: str = "torch", batch_tokens: int | None = None) -> Translator:
        """A Translator from a run directory (checkpoint_avg.pt, else _best, else _last) or a checkpoint file."""
        if engine not in ENGINES:
            raise UserError(f"engine '{engine}' is not available; use {', '.join(ENGINES)}")
        if precision not in PRECISIONS:
            raise UserError(f"precision '{precision}' is unknown; use {', '.join(PRECISIONS)}")
        dev = resolve_device(device)
        file = find_checkpoint(run_dir_or_checkpoint)
        model, tokenizer, cfg = load_checkpoint(file, dev)
        name = f"{file.parent.name}/{file.name}"  # no absolute path: the name is shown to HTTP clients
        return cls(model, tokenizer, cfg, dev, resolve_precision(precision, dev), name, batch_tokens)

    @property
    def default_beam(self) -> int:
        """The beam translate() uses when none is given: the checkpoint's decode.beam."""
        return self.cfg.decode.beam

    def count_tokens(self, texts: list[str]) -> int:
        """Source tokens (eos included) the texts encode to: what a batch of them costs."""
        return sum(len(self.tokenizer.encode_src(t)) for t in texts if t.strip())

    def translate(self, texts: list[str], beam: int | None = None, nbest: int = 1, len_penalty: float | None = None,
                  max_len_a: float | None = None, max_len_b: float | None = None,
                  attention: bool = False) -> list[Translation]:
        """Translations of texts in input order; unset settings come from the checkpoint's decode section."""
        if isinstance(texts, str) or not isinstance(texts, list | tuple):
            raise TypeError("texts must be a list of strings")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"texts[{bad}] must be a string, got {type(texts[bad]).__name__}")
        dec = self.cfg.decode
        beam = _check_int("beam", dec.beam if beam is None else beam, 1)
        nbest = _check_int("nbest", nbest, 1, beam)
        opts = dict(beam=beam,
                    len_penalty=_check_float("len_penalty", dec.len_penalty if len_penalty is None else len_penalty),
                    max_len_a=_check_float("max_len_a", dec.max_len_a if max_len_a is None else max_len_a, 0),
                    max_len_b=_check_float("max_len_b", dec.max_len_b if max_len_b is None else max_len_b, 0),
                    batch_tokens=self.batch_tokens, device=self.device, precision=self.precision)
        if not isinstance(attention, bool):
            raise TypeError(f"attention must be a bool, got {type(attention).__name__}")
        texts = list(texts)
        with self._lock:
            # nbest > 1 needs beam search even at beam 1 (greedy keeps no scores), as decoding.translate_nbest
            found = search_texts(self.model, self.tokenizer, texts, nbest=nbest, greedy_ok=nbest == 1, **opts)
            out = []
            for text, hyps in zip(texts, found, strict=True):
                pairs = [(self.tokenizer.decode_tgt(seq) if seq else "", _score(s)) for seq, s in hyps]
                result = Translation(pairs[0][0], pairs[0][1], pairs)
                if attention:
                    result.src_tokens, result.tgt_tokens, result.attention = self._attention(text, hyps[0][0])
                out.append(result)
        return out

    def _attention(self, text: str, tokens: list[int]) -> tuple[list[str], list[str], list]:
        """(source pieces, output pieces, cross-attention [layer][head][tgt][src]) of one hypothesis."""
        (src_ids,) = encode_sources(self.tokenizer, [text], source_limit(self.model, None))
        if src_ids is None:  # an empty line was not translated: nothing attended
            return [], [], []
        src = torch.tensor([src_ids], device=self.device)  # (1,S)
        tgt_in = torch.tensor([[BOS_ID, *tokens]], device=self.device)  # (1,T): row i is the step outputting token i
        with torch.inference_mode(), autocast(self.device, self.precision):
            cross = self.model.forward_with_attention(src, tgt_in).cross  # per decoder layer (1,H,T,S)
        weights = [layer[0].float().cpu().tolist() for layer in cross]
        pieces = self.tokenizer.src_pieces(text)  # ends with eos; a truncated source keeps its first pieces + eos
        if len(pieces) > len(src_ids):
            pieces = pieces[:len(src_ids) - 1] + pieces[-1:]
        return _fit(pieces, len(src_ids)), _fit(self.tokenizer.tgt_pieces([*tokens, EOS_ID]), len(tokens) + 1), weights
