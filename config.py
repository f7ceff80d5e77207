"""Configuration: YAML sections mapped onto dataclasses, dotted command-line overrides, clean user errors.

A config file has four sections, each a dataclass below (``model`` is ``transformer_model.ModelConfig``):

    data:   what to translate and how to tokenize it          (DataConfig)
    model:  the Transformer's dimensions                       (ModelConfig)
    train:  optimisation, batching, checkpoints                (TrainConfig)
    decode: beam search settings used for BLEU and translate   (DecodeConfig)

Every script accepts trailing ``section.key=value`` overrides, parsed as YAML scalars and type-checked
against the dataclass field, e.g. ``python train_transformer.py --config configs/tiny.yaml train.max_steps=50``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from runtime import UserError, write_text
from transformer_model import ModelConfig


@dataclass
class DataConfig:
    """Where the parallel text comes from and how it is tokenized (see data_preparation.py)."""

    dataset: str = "multi30k"  # multi30k | files | wmt14
    src_lang: str = "en"
    tgt_lang: str = "de"
    raw_dir: str = "data/multi30k"  # raw files are read here, or downloaded here when absent
    prepared_dir: str = "data/prepared"  # encoded splits are cached under this folder
    tokenizer: str = "bpe"  # bpe (joint SentencePiece) | spacy (blank tokenizers, one vocabulary per side)
    vocab_size: int = 8000  # bpe: size of the joint vocabulary
    min_freq: int = 2  # spacy: words seen fewer times become <unk>
    lowercase: bool = False  # lowercase all text (the Multi30k papers' lc data): outputs are then lowercase too
    max_len: int = 250  # training pairs with a side longer than this (in tokens) are dropped
    max_len_ratio: float = 3.0  # ... and pairs whose length ratio exceeds this
    valid_split: str = "val"
    test_splits: list[str] = field(default_factory=lambda: ["test_2016_flickr", "test_2017_flickr", "test_2017_mscoco"])
    train_prefix: str = ""  # dataset "files": {prefix}.{lang} text files, one sentence per line
    valid_prefix: str = ""
    test_prefixes: list[str] = field(default_factory=list)
    sample_size: int = 2_000_000  # bpe: sentences sampled to train SentencePiece (input_sentence_size)
    num_workers: int = 0  # processes used to encode large corpora (0 = one per CPU core, at most 8)
    bidirectional: bool = False  # bpe: the training split also holds every pair reversed (tgt -> src)


@dataclass
class TrainConfig:
    """Optimisation as in the paper §5.3-5.4, plus checkpointing and evaluation."""

    out_dir: str = "runs/multi30k_en_de"
    seed: int = 1
    max_tokens: int = 4096  # tokens per batch (source or target side, padding included)
    pad_multiple: int = 8  # batch lengths rounded up to this: 8 suits GPUs and torch.compile; 1 pads least (CPU)
    update_freq: int = 1  # gradient accumulation: batches per optimizer step
    max_steps: int = 10000
    max_epochs: int = 0  # 0 = no limit
    max_minutes: float = 0.0  # stop after this much training time (0 = no limit)
    lr_factor: float = 1.0  # multiplies the schedule of eq. 3
    warmup: int = 4000
    cooldown: float = 0.0  # decay the lr linearly to 0 over this last fraction of the run (0 = paper schedule only)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # > 0: AdamW decay of the weight matrices and embeddings (not gains or biases)
    label_smoothing: float = 0.1
    rdrop_alpha: float = 0.0  # > 0: R-Drop (Liang et al. 2021), each batch twice + alpha * symmetric KL; 2x compute
    bpe_dropout: float = 0.0  # > 0: BPE-dropout (Provilkov et al. 2020), training pairs re-cut each epoch (bpe only)
    src_token_drop: float = 0.0  # > 0: Token Drop (Zhang et al. 2020), training source pieces -> <unk> with this p
    clip_norm: float = 0.0  # 0 = no gradient clipping
    precision: str = "auto"  # auto | fp32 | bf16 | fp16; auto = bf16 where the hardware has it natively, else fp32
    compile: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eval_every: int = 500
    eval_bleu_sentences: int = 0  # 0 = whole validation split for the greedy BLEU during training
    patience: int = 0  # stop after this many evals without a better val BLEU (0 = never)
    keep_last: int = 5  # step checkpoints kept on disk
    average_last: int = 5  # the final model averages the last N step checkpoints (0 or 1 = no averaging)
    ema_decay: float = 0.0  # > 0: also keep an exponential moving average of the weights, a final-model candidate
    log_every: int = 50
    save_every: int = 0  # also rewrite checkpoint_last.pt every N steps (0 = only at evaluations)
    # Fine-tuning: start a NEW run from the weights of a trained run (its dir or a .pt file), encoding data.* with
    # that run's tokenizer, under a fresh optimizer and lr schedule (train_transformer.read_init_from). Saved with
    # the run: resuming it then encodes with RUN/tokenizer and never loads these weights again.
    init_from: str = ""
    # Run control, actions of one command (--resume, --overwrite), never saved with a run (rundir.RUN_CONTROL);
    # the trainer ignores them in a config file.
    resume: bool = False  # continue the run in out_dir from its checkpoint_last.pt
    overwrite: bool = False  # replace the run in out_dir
    max_bad_steps: int = 10  # non-finite losses in a row before training stops


@dataclass
class DecodeConfig:
    """Beam search (paper §6.1: beam 4, length penalty 0.6, max length src_len + 50)."""

    beam: int = 4
    len_penalty: float = 0.6
    max_len_a: float = 1.0
    max_len_b: int = 50
    batch_tokens: int = 4000
    # fp32 by default whatever the training precision: the report's BLEU must be what translate.py's defaults
    # give, and bf16 decoding changes some outputs; auto = runtime.resolve_precision (bf16 where native)
    precision: str = "fp32"


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "decode": DecodeConfig}  # Config's fields


def _check_type(where: str, value, annotation):
    """Return value converted to the field's type, or raise a UserError naming the key."""
    tp = annotation
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            try:
                return _check_type(where, value, arg)
            except UserError:
                pass
        raise UserError(f"{where}: expected {tp}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp) or (object,)
        if not isinstance(value, list):
            raise UserError(f"{where}: expected a list, got {value!r}")
        return [_check_type(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        return value
    raise UserError(f"{where}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")


def _build_section(name: str, values: dict, base=None):
    cls = SECTIONS[name]
    fields = typing.get_type_hints(cls)
    obj = base if base is not None else cls()
    if not isinstance(values, dict):
        raise UserError(f"section '{name}' must be a mapping of key: value, got {values!r}")
    for key, value in values.items():
        if key not in fields:
            raise UserError(f"unknown key '{name}.{key}'; valid keys: {', '.join(sorted(fields))}")
        setattr(obj, key, _check_type(f"{name}.{key}", value, fields[key]))
    return obj


def config_from_dict(d: dict) -> Config:
    """Build a Config from nested plain values, rejecting unknown sections and keys."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise UserError("a config file must be a YAML mapping with sections data/model/train/decode")
    for name in d:
        if name not in SECTIONS:
            raise UserError(f"unknown config section '{name}'; valid sections: {', '.join(SECTIONS)}")
    return Config(**{name: _build_section(name, d.get(name) or {}) for name in SECTIONS})


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict of the config: what checkpoints and config.yaml hold."""
    return dataclasses.asdict(cfg)


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``section.key=value`` strings (values parsed as YAML scalars) with the same checks as the file."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"override '{item}' must look like section.key=value (e.g. train.max_steps=100)")
        path, raw = item.split("=", 1)
        section, key = path.split(".", 1)
        if section not in SECTIONS:
            raise UserError(f"unknown config section '{section}' in '{item}'; valid sections: {', '.join(SECTIONS)}")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise UserError(f"cannot parse value in override '{item}': {e}") from None
        _build_section(section, {key: value}, base=getattr(cfg, section))
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping: plain YAML keeps the last one, so a second
    `train:` block would silently reset every training setting of the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` then overriding a key is fine
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise UserError(f"config file {key_node.start_mark.name}: key '{key}' appears twice (lines "
                                    f"{seen[key]} and {line}); the second would silently replace the first")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path) -> dict:
    """Read a YAML file with the safe loader, turning every failure into one clear line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"config file not found: {p}")
    if p.is_dir():
        raise UserError(f"config path is a directory, expected a YAML file: {p}")
    try:
        with open(p, encoding="utf-8") as f:  # a stream, so that marks (and messages) name the file
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise UserError(f"config file is not UTF-8 text: {p}") from None
    except yaml.MarkedYAMLError as e:  # where and what: the first line alone ("while scanning ...") says neither
        where = f" (line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1})" if e.problem_mark else ""
        raise UserError(f"config file {p} is not valid YAML: {e.problem or e.context}{where}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None


def _spacy_missing_language(d: DataConfig) -> str:
    """The first of data.src_lang/tgt_lang spaCy has no tokenizer for ('' if none), else spaCy fails with a
    traceback mid-preparation. spaCy is imported only for data.tokenizer=spacy (it takes a second or two)."""
    if d.tokenizer != "spacy":
        return ""
    try:
        import spacy.util
    except ImportError:
        raise UserError("data.tokenizer=spacy needs the spacy package (pip install spacy), or use bpe") from None
    for lang in (d.src_lang, d.tgt_lang):
        try:
            spacy.util.get_lang_class(lang)
        except (ImportError, ValueError):  # spaCy's E048 for an unknown code; ValueError: an empty one
            return lang
    return ""


def _data_checks(d: DataConfig) -> list[tuple[bool, str]]:
    """(ok, message) for data.*: each message names the key to fix."""
    spacy_missing = _spacy_missing_language(d)
    return [
        (d.dataset in ("multi30k", "files", "wmt14"), f"data.dataset '{d.dataset}' is unknown (multi30k|files|wmt14)"),
        (d.tokenizer in ("bpe", "spacy"), f"data.tokenizer '{d.tokenizer}' is unknown; use bpe or spacy"),
        (d.src_lang != d.tgt_lang, "data.src_lang and data.tgt_lang must differ"),
        (100 <= d.vocab_size < 1 << 31, "data.vocab_size must be at least 100 and below 2**31 (SentencePiece)"),
        (d.min_freq >= 1, "data.min_freq must be >= 1"),
        (d.sample_size >= 1 and d.num_workers >= 0, "data.sample_size must be >= 1 and data.num_workers >= 0"),
        (d.valid_split != "train", "data.valid_split cannot be 'train': it would replace the training split"),
        (d.dataset == "files" or not {"train", d.valid_split} & set(d.test_splits),  # files: test_prefixes instead
         "data.test_splits cannot name 'train' or data.valid_split (testing on training or validation data)"),
        (not spacy_missing, f"data.tokenizer=spacy: spaCy has no language '{spacy_missing}' (data.src_lang/tgt_lang)"),
        (d.max_len >= 1 and d.max_len_ratio >= 1.0, "data.max_len must be >= 1 and data.max_len_ratio >= 1"),
        (not d.bidirectional or d.tokenizer == "bpe",
         "data.bidirectional needs data.tokenizer: bpe (one vocabulary for both languages)"),
    ]


def _train_checks(t: TrainConfig, d: DataConfig) -> list[tuple[bool, str]]:
    """(ok, message) for train.*."""
    return [
        (t.max_tokens >= 16, "train.max_tokens must be at least 16"),
        (0 <= t.seed < 1 << 32, f"train.seed must be in [0, 2**32) (numpy's seed range), got {t.seed}"),
        (t.pad_multiple >= 1, "train.pad_multiple must be >= 1 (1 = no rounding)"),
        (t.update_freq >= 1, "train.update_freq must be >= 1"),
        (t.max_steps >= 1, "train.max_steps must be >= 1"),
        (t.warmup >= 1, "train.warmup must be >= 1 (the schedule of eq. 3 divides by it)"),
        (t.lr_factor > 0, "train.lr_factor must be > 0"),
        (0.0 <= t.cooldown <= 1.0, "train.cooldown must be in [0, 1] (a fraction of the run)"),
        (0.0 <= t.adam_beta1 < 1.0 and 0.0 <= t.adam_beta2 < 1.0, "train.adam_beta1/2 must be in [0, 1)"),
        (t.adam_eps > 0, "train.adam_eps must be > 0"),
        (t.weight_decay >= 0, "train.weight_decay must be >= 0"),
        (min(t.max_epochs, t.max_minutes, t.patience, t.save_every) >= 0,
         "train.max_epochs, max_minutes, patience and save_every must be >= 0 (0 = off)"),
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device) is not None,
         f"train.device '{t.device}' is unknown; use auto, cpu, cuda or cuda:N"),
        (0.0 <= t.label_smoothing < 1.0, "train.label_smoothing must be in [0, 1)"),
        (t.rdrop_alpha >= 0.0, "train.rdrop_alpha must be >= 0"),
        (0.0 <= t.bpe_dropout < 1.0, "train.bpe_dropout must be in [0, 1)"),
        (0.0 <= t.src_token_drop < 1.0, "train.src_token_drop must be in [0, 1)"),
        (t.bpe_dropout == 0.0 or d.tokenizer == "bpe", "train.bpe_dropout needs data.tokenizer: bpe (SentencePiece)"),
        (t.clip_norm >= 0, "train.clip_norm must be >= 0"),
        (t.precision in ("auto", "fp32", "bf16", "fp16"),
         f"train.precision '{t.precision}' is unknown (auto|fp32|bf16|fp16)"),
        (t.eval_every >= 1 and t.log_every >= 1, "train.eval_every and train.log_every must be >= 1"),
        (t.keep_last >= 1, "train.keep_last must be >= 1"),
        (t.out_dir.strip() != "", "train.out_dir is empty; give the folder for the run"),  # "" means the cwd
        (t.eval_bleu_sentences >= 0, "train.eval_bleu_sentences must be >= 0 (0 = the whole validation split)"),
        (t.average_last >= 0 and t.max_bad_steps >= 1, "train.average_last must be >= 0, train.max_bad_steps >= 1"),
        (0.0 <= t.ema_decay < 1.0, "train.ema_decay must be in [0, 1) (0 = off; 0.999 averages ~1000 updates)"),
    ]


def _decode_checks(dec: DecodeConfig, tgt_vocab_size: int) -> list[tuple[bool, str]]:
    """(ok, message) for decode.*; tgt_vocab_size 0 while the tokenizer is not built yet."""
    return [
        (dec.beam >= 1, "decode.beam must be >= 1"),
        # beam search ranks 2*beam candidates among the tokens it can emit (all but <pad> and <bos>)
        (not tgt_vocab_size or 2 * dec.beam <= tgt_vocab_size - 2,
         f"decode.beam={dec.beam} is too large for the target vocabulary of {tgt_vocab_size} tokens: "
         f"beam search needs 2*beam <= {tgt_vocab_size - 2}; use decode.beam <= "
         f"{max((tgt_vocab_size - 2) // 2, 1)}"),
        (dec.max_len_a >= 0 and dec.max_len_b >= 1, "decode.max_len_a must be >= 0 and decode.max_len_b >= 1"),
        (dec.batch_tokens >= 16, "decode.batch_tokens must be at least 16"),
        (dec.precision in ("auto", "fp32", "bf16"), f"decode.precision '{dec.precision}' is unknown (auto|fp32|bf16)"),
    ]


def validate(cfg: Config) -> Config:
    """Reject impossible values early, with the key to fix."""
    try:  # vocabulary sizes come from the tokenizer later; check the rest now
        probe = dataclasses.replace(cfg.model, src_vocab_size=cfg.model.src_vocab_size or 1000,
                                    tgt_vocab_size=cfg.model.tgt_vocab_size or 1000)
        probe.validate()
    except ValueError as e:
        raise UserError(f"model: {e}") from None
    for section in dataclasses.fields(cfg):  # nan passes every comparison below, inf most of them
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{section.name}.{f.name} must be a finite number, got {value}")
    checks = (_data_checks(cfg.data) + _train_checks(cfg.train, cfg.data)
              + _decode_checks(cfg.decode, cfg.model.tgt_vocab_size))
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if cfg.train.average_last > cfg.train.keep_last:
        raise UserError(f"train.average_last ({cfg.train.average_last}) cannot exceed train.keep_last "
                        f"({cfg.train.keep_last})")
    return cfg


# Fine-tuning (train.init_from) keeps the source model's architecture and tokenizer. Of the model fields only
# these may differ: the dropout rates act in training alone, and the sinusoid table of max_positions holds no
# weights (positions past it are computed on the fly). Vocabulary sizes and pad id come from the inherited tokenizer,
# output_size from the source's output vocabulary.
FINETUNE_FREE_MODEL_FIELDS = ("dropout", "attn_dropout", "act_dropout", "max_positions")
_DERIVED_MODEL_FIELDS = ("src_vocab_size", "tgt_vocab_size", "pad_id", "output_size")


def finetune_mismatches(cfg: Config, source: Config) -> list[str]:
    """What in cfg contradicts the source run of train.init_from, one phrase per field ([] if nothing): the model
    architecture, and the data settings that define the vocabulary it inherits (languages, tokenizer kind,
    data.vocab_size for bpe, data.min_freq for spacy, data.lowercase)."""
    d = ["tokenizer", "src_lang", "tgt_lang", "lowercase",
         *(("vocab_size",) if source.data.tokenizer == "bpe" else ("min_freq",))]
    m = [f.name for f in dataclasses.fields(ModelConfig)
         if f.name not in FINETUNE_FREE_MODEL_FIELDS + _DERIVED_MODEL_FIELDS]
    return [f"{section}.{key} is {getattr(getattr(cfg, section), key)!r} here but "
            f"{getattr(getattr(source, section), key)!r} in the source"
            for section, keys in (("data", d), ("model", m)) for key in keys
            if getattr(getattr(cfg, section), key) != getattr(getattr(source, section), key)]


def load_config(path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply command-line overrides, validate."""
    cfg = config_from_dict(read_yaml(path))
    apply_overrides(cfg, overrides or [])
    return validate(cfg)


def save_config(cfg: Config, path) -> None:
    """Written atomically: a run killed meanwhile keeps a readable config.yaml for resuming."""
    write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
