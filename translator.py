"""Use a trained model from Python: load a run once, translate lists of sentences, get scores, n-best lists and
cross-attention weights as plain Python values.

    from translator import Translator
    tr = Translator.load("runs/multi30k_en_de")
    (t,) = tr.translate(["A dog runs in the snow."], beam=4, nbest=3, attention=True)
    print(t.text, t.score, t.hypotheses)
    t.attention[-1][0]  # last decoder layer, head 1: rows are output pieces t.tgt_tokens, columns t.src_tokens

    Translator.load("exported/en_de")  # a folder written by export.py: engine "auto" picks ctranslate2
    Translator.load_ensemble(["runs/a", "runs/b"])  # two runs of one tokenizer decoded as one (torch)

Two engines give the same Translation types. torch: decoding.search_texts (length-sorted batches of about
batch_tokens source tokens, beam search with the KV cache, greedy search at beam 1), so results equal
translate.py's for the same settings. ctranslate2: ct2_engine over an export.py folder, the same search rules
(greedy output identical; where beam search may differ is in ct2_engine's docstring); no attention weights.
One lock serialises model calls: a Translator can be shared between threads (the HTTP server in server.py does).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ct2_engine
from checkpoint import find_checkpoint, load_checkpoint
from config import Config, config_from_dict
from data_preparation import BOS_ID, EOS_ID, tokenizer_fingerprint
from decoding import Ensemble, encode_sources, search_texts, source_limit
from runtime import UserError, autocast, resolve_device, resolve_precision

ENGINES = ("torch", "ctranslate2")
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "auto")  # int8: ctranslate2 only (CTranslate2's int8 kernels)


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


def locate(path: str | Path, engine: str = "auto") -> tuple[str, Path]:
    """(engine, what it loads) for a run directory or .pt file (torch) or an export.py folder (ctranslate2).

    'auto' picks ctranslate2 for a folder holding ct2_engine.EXPORT_FILE, else torch. A mismatch is a one-line
    error: an export holds no PyTorch weights, and a run is not exported on the fly (that writes a folder of the
    model's size somewhere the user did not choose; export.py does it once)."""
    if engine not in (*ENGINES, "auto"):
        raise UserError(f"engine '{engine}' is unknown; use auto, {', '.join(ENGINES)}")
    p = Path(path)
    exported = p.is_dir() and (p / ct2_engine.EXPORT_FILE).is_file()
    if engine == "auto":
        engine = "ctranslate2" if exported else "torch"
    if engine == "torch" and exported:
        raise UserError(f"{p} is a CTranslate2 export, it holds no PyTorch weights: use engine ctranslate2 (or auto)")
    if engine == "ctranslate2" and not exported:
        if not p.exists():
            raise UserError(f"model not found: {p} (engine ctranslate2 needs a folder written by export.py)")
        raise UserError(f"{p} is not a CTranslate2 export (no {ct2_engine.EXPORT_FILE}); export it first: "
                        f"python export.py --checkpoint {p} --to ctranslate2 OUT_DIR")
    return engine, p if engine == "ctranslate2" else find_checkpoint(p)


def export_config(info: dict) -> Config:
    """The model, decode and data sections an export records. Exports made before the whole data section was
    recorded name no dataset: their data section knows the languages only, and no split."""
    data = info["data"] if "dataset" in info["data"] else {
        **info["data"], "dataset": "files", "valid_split": "", "test_splits": [], "test_prefixes": []}
    return config_from_dict({"data": data, "model": info["model"], "decode": info["decode"]})


class Translator:
    """A loaded model with its tokenizer and decode defaults; translate() is thread-safe.

    model is a transformer_model.Transformer (engine torch) or a ct2_engine.Ct2Translator (engine ctranslate2);
    precision is ours (fp32, bf16, fp16) for torch and CTranslate2's compute type (float32, int8...) for it."""

    def __init__(self, model, tokenizer, cfg: Config, device: torch.device, precision: str, name: str,
                 batch_tokens: int | None = None, max_src_len: int | None = None, use_cache: bool = True):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.device, self.precision, self.name = device, precision, name
        self.engine = "ctranslate2" if isinstance(model, ct2_engine.Ct2Translator) else "torch"
        self.batch_tokens = _check_int("batch_tokens", cfg.decode.batch_tokens if batch_tokens is None
                                       else batch_tokens, 1)
        self.max_src_len = None if max_src_len is None else _check_int("max_src_len", max_src_len, 2)
        self.use_cache = use_cache  # False recomputes every prefix (torch only): slow, for comparisons
        self._lock = threading.Lock()  # the model and its KV caches are not safe to run from two threads at once

    @classmethod
    def load(cls, run_dir_or_checkpoint: str | Path, device: str = "auto", precision: str | None = None,
             engine: str = "auto", batch_tokens: int | None = None, max_src_len: int | None = None,
             use_cache: bool = True) -> Translator:
        """A Translator from a run directory (checkpoint_avg.pt, else _ema, _best, _last), a checkpoint file, or a
        folder written by export.py (engine: see locate). precision None: the run's decode.precision."""
        engine, source = locate(run_dir_or_checkpoint, engine)
        if precision is not None and precision not in PRECISIONS:
            raise UserError(f"precision '{precision}' is unknown; use {', '.join(PRECISIONS)}")
        dev = resolve_device(device)
        if engine == "ctranslate2":
            if not use_cache:
                raise UserError("use_cache=False (--no-cache) needs engine torch: CTranslate2 always caches")
            info = ct2_engine.read_info(source)
            compute = ct2_engine.compute_type(precision, info, dev)
            # CTranslate2 gets torch's thread count, which OMP_NUM_THREADS and torch.set_num_threads set
            model = ct2_engine.load(source, dev.type, compute, torch.get_num_threads(), dev.index or 0)
            return cls(model, model.tokenizer, export_config(info), dev, model.translator.compute_type, source.name,
                       batch_tokens, max_src_len)
        if precision == "int8":
            raise UserError("precision int8 needs engine ctranslate2: export the run first (python export.py "
                            "... --quantization int8)")
        model, tokenizer, cfg = load_checkpoint(source, dev)
        name = f"{source.parent.name}/{source.name}"  # no absolute path: the name is shown to HTTP clients
        return cls(model, tokenizer, cfg, dev, resolve_precision(precision or cfg.decode.precision, dev), name,
                   batch_tokens, max_src_len, use_cache)

    @classmethod
    def load_ensemble(cls, runs_or_checkpoints: list, device: str = "auto", precision: str | None = None,
                      batch_tokens: int | None = None, max_src_len: int | None = None,
                      use_cache: bool = True) -> Translator:
        """One Translator over several runs of the same tokenizer (torch engine), searching with the mean of
        their probabilities (decoding.Ensemble). Settings (decode section, precision) come from the first."""
        if len(runs_or_checkpoints) < 2:
            raise UserError("an ensemble needs at least two runs or checkpoints")
        members = []
        for path in runs_or_checkpoints:
            engine, source = locate(path, "torch")
            members.append((source, cls.load(source, device, precision, engine, batch_tokens, max_src_len, use_cache)))
        (first_source, first), *others = members
        sha = tokenizer_fingerprint(first.tokenizer.folder)
        for source, other in others:
            if tokenizer_fingerprint(other.tokenizer.folder) != sha:
                raise UserError(f"{source} was trained with another tokenizer than {first_source}: an ensemble "
                                "needs runs that read and write the same token ids")
        model = Ensemble([t.model for _, t in members])
        name = " + ".join(t.name for _, t in members)
        return cls(model, first.tokenizer, first.cfg, first.device, first.precision, name, first.batch_tokens,
                   first.max_src_len, use_cache)

    @property
    def default_beam(self) -> int:
        """The beam translate() uses when none is given: the checkpoint's decode.beam."""
        return self.cfg.decode.beam

    def count_tokens(self, texts: list[str]) -> int:
        """Source tokens (eos included) the texts encode to: what a batch of them costs."""
        return sum(len(self.tokenizer.encode_src(t)) for t in texts if t.strip())

    def translate(self, texts: list[str], beam: int | None = None, nbest: int = 1, len_penalty: float | None = None,
                  max_len_a: float | None = None, max_len_b: float | None = None, attention: bool = False,
                  progress: bool = False, first_line: int = 1) -> list[Translation]:
        """Translations of texts in input order; unset settings come from the checkpoint's decode section.

        progress: a progress bar on stderr (torch); first_line: the line number of texts[0] in warnings about
        over-long lines (a caller translating a stream in chunks)."""
        if isinstance(texts, str) or not isinstance(texts, list | tuple):
            raise TypeError("texts must be a list of strings")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"texts[{bad}] must be a string, got {type(texts[bad]).__name__}")
        dec = self.cfg.decode
        beam = _check_int("beam", dec.beam if beam is None else beam, 1)
        nbest = _check_int("nbest", nbest, 1, beam)
        search = dict(beam=beam,
                      len_penalty=_check_float("len_penalty", dec.len_penalty if len_penalty is None else len_penalty),
                      max_len_a=_check_float("max_len_a", dec.max_len_a if max_len_a is None else max_len_a, 0),
                      max_len_b=_check_float("max_len_b", dec.max_len_b if max_len_b is None else max_len_b, 0))
        if not isinstance(attention, bool):
            raise TypeError(f"attention must be a bool, got {type(attention).__name__}")
        if attention and self.engine != "torch":
            raise ValueError(f"attention=True needs engine torch; this Translator runs {self.engine}")
        if attention and isinstance(self.model, Ensemble):
            raise ValueError("attention=True needs a single model; this Translator is an ensemble")
        texts = list(texts)
        with self._lock:
            if self.engine == "ctranslate2":
                return self._translate_ct2(texts, nbest, search, first_line)
            # nbest > 1 needs beam search even at beam 1 (greedy keeps no scores), as decoding.translate_nbest
            found = search_texts(self.model, self.tokenizer, texts, nbest=nbest, greedy_ok=nbest == 1,
                                 batch_tokens=self.batch_tokens, device=self.device, precision=self.precision,
                                 use_cache=self.use_cache, max_src_len=self.max_src_len, progress=progress,
                                 first_line=first_line, **search)
            out = []
            for text, hyps in zip(texts, found, strict=True):
                pairs = [(self.tokenizer.decode_tgt(seq) if seq else "", _score(s)) for seq, s in hyps]
                result = Translation(pairs[0][0], pairs[0][1], pairs)
                if attention:
                    result.src_tokens, result.tgt_tokens, result.attention = self._attention(text, hyps[0][0])
                out.append(result)
        return out

    def _translate_ct2(self, texts: list[str], nbest: int, search: dict, first_line: int) -> list[Translation]:
        """The same Translations from CTranslate2 (ct2_engine maps our search onto it)."""
        found = self.model.translate(texts, nbest=nbest, batch_tokens=self.batch_tokens, max_src_len=self.max_src_len,
                                     first_line=first_line, **search)
        out = []
        for text, hyps in zip(texts, found, strict=True):
            if search["beam"] == 1 and text.strip():  # as the torch engine's greedy search: no score
                hyps = [(h, None) for h, _ in hyps]
            out.append(Translation(hyps[0][0], hyps[0][1], list(hyps)))
        return out

    def _attention(self, text: str, tokens: list[int]) -> tuple[list[str], list[str], list]:
        """(source pieces, output pieces, cross-attention [layer][head][tgt][src]) of one hypothesis."""
        (src_ids,) = encode_sources(self.tokenizer, [text], source_limit(self.model, self.max_src_len))
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
