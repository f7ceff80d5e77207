"""Data preparation: raw parallel text -> tokenizer + memory-mapped token arrays, and token-count batches.

Read top to bottom: tokenizers -> encode and cache -> reading, collate and batching. Finding or downloading
the raw files of each split is corpora.py's job.

Flow: get the raw files of each split (corpora.py) -> count and check them -> train the tokenizer on a
sample of the training split -> encode every split in worker processes -> filter training pairs -> store per
split and side a flat token array and offsets (.npy), the raw valid/test text (BLEU references) and meta.json,
in one cached folder. Text is streamed throughout, so WMT14's 4.5 M pairs (docs/wmt14.md) fit in little memory.
The trainer then reads a split with load_split(), groups it with TokenBatchSampler and pads it with collate().

The same inputs and settings give the same bytes (tokenizer files included, wherever and however often they
are prepared), so a run keeps resuming after its prepared folder is rebuilt: see _reproducible_spm_model.

A damaged prepared folder (truncated or invalid meta.json / tokenizer.json / .npy, a missing file) is never
used and never silently replaced (a running job may be reading it): prepare() checks a folder before reusing
it, and load_meta, load_split and load_tokenizer check what they read; each stops with one line naming the
folder and saying to rerun with --force, which rebuilds it.

Token ids are the same for both tokenizers and both languages: pad=0, unk=1, bos=2, eos=3. The encoder
reads tokens + [eos]; the decoder reads [bos] + tokens and predicts tokens + [eos] (auto-regressive, §3).

    python data_preparation.py --config configs/multi30k_en_de.yaml [--force] [data.tokenizer=spacy ...]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from tqdm import tqdm

from config import DataConfig, load_config
from corpora import DATASETS, WMT14_LINES, count_lines, file_list, iter_lines, wmt14_corpus
from runtime import UserError, cli_main, one_line, temp_path, write_text

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")
FORMAT_VERSION = 1  # part of the cache key: bump it when the prepared layout changes
ENCODE_CHUNK = 20_000  # pairs per encode task: the progress bar moves, a worker's memory stays small
BIG_FILE = 16 << 20  # inputs at least this big have their sha256 cached in prepared_dir/input_sha256.json
SPM_TRAINER_SPEC = 2  # field number of ModelProto.trainer_spec in sentencepiece_model.proto
SPM_MACHINE_FIELDS = (1, 2, 16)  # TrainerSpec input, model_prefix, num_threads: where and how it was built


def damaged(folder, what: str) -> UserError:
    """The one error of a prepared folder that cannot be used as it is (see the module docstring)."""
    return UserError(f"prepared data folder {folder} is damaged ({what}); rerun with --force "
                     "(python data_preparation.py --config CONFIG --force) to rebuild it")


def _sha256_file(path: Path, cache: dict | None = None) -> str:
    """sha256 of a file; cache maps 'path size mtime' to known sums so that 1.4 GB of WMT14 is read once."""
    stat = path.stat()
    stamp = f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}"
    if cache is not None and stamp in cache:
        return cache[stamp]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if cache is not None:
        cache[stamp] = digest.hexdigest()
    return digest.hexdigest()


def _write_json(path: Path, value) -> None:
    """Written atomically, so a reader never sees half a file."""
    write_text(path, json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def _batched(iterable, n: int):
    """Lists of n items (the last one shorter): itertools.batched of Python 3.12."""
    iterator = iter(iterable)
    while batch := list(itertools.islice(iterator, n)):
        yield batch


def _bar(total: int, desc: str) -> tqdm:
    """A progress bar (on stderr), left out for work that takes well under a second."""
    return tqdm(total=total, desc=desc, unit=" lines", leave=False, disable=total < ENCODE_CHUNK)


# ------------------------------------------------------------------------------------------------ tokenizers


class Tokenizer:
    """What both tokenizers share: special ids, eos/bos conventions, saving; subclasses map text <-> ids."""

    kind, joint = "", False
    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, folder: Path, info: dict):
        self.folder, self.info = Path(folder), info
        self.src_lang, self.tgt_lang = info["src_lang"], info["tgt_lang"]
        self.lowercase = info["lowercase"]
        self.threads = min(os.cpu_count() or 1, 8)

    @property
    def src_vocab_size(self) -> int:
        return self.vocab_size(self.src_lang)

    @property
    def tgt_vocab_size(self) -> int:
        return self.vocab_size(self.tgt_lang)

    def encode_src(self, text: str) -> list[int]:
        return self.encode_lines([text], self.src_lang)[0] + [EOS_ID]

    def encode_tgt(self, text: str) -> list[int]:
        return self.encode_lines([text], self.tgt_lang)[0]

    def decode_tgt(self, ids) -> str:
        """Text of a hypothesis: cut at the first eos, drop the specials, detokenize."""
        ids = [int(i) for i in ids]
        ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        return self.decode([i for i in ids if i >= len(SPECIALS)], self.tgt_lang)

    def src_pieces(self, text: str) -> list[str]:
        return self.pieces(self.encode_src(text), self.src_lang)

    def tgt_pieces(self, ids) -> list[str]:
        return self.pieces([int(i) for i in ids], self.tgt_lang)

    def save(self, folder) -> None:
        """Copy what translating needs (model or vocabularies, tokenizer.json) into e.g. RUN_DIR/tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.info["files"]:
            if (folder / name).resolve() != (self.folder / name).resolve():
                shutil.copyfile(self.folder / name, folder / name)
        _write_json(folder / "tokenizer.json", self.info)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value, pos, shift = value | (byte & 0x7F) << shift, pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _proto_fields(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(field number, the field as stored, its payload) of each field of a serialized protobuf message."""
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = _read_varint(data, pos)
        wire, payload_start = key & 7, pos
        if wire == 0:
            pos = _read_varint(data, pos)[1]
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            length, payload_start = _read_varint(data, pos)
            pos = payload_start + length
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield key >> 3, data[start:pos], data[payload_start:pos]


def _reproducible_spm_model(data: bytes) -> bytes:
    """spm.model without what records where and how it was built (the random temporary build folder, the
    thread count), which otherwise makes every rebuild of the same data a different tokenizer to
    tokenizer_fingerprint, and every run trained on it impossible to resume. Edited on the wire
    format because the protobuf package is not a dependency; these fields are optional, encoding never reads
    them."""
    out = bytearray()
    for number, field, payload in _proto_fields(data):
        if number == SPM_TRAINER_SPEC:
            spec = b"".join(f for n, f, _ in _proto_fields(payload) if n not in SPM_MACHINE_FIELDS)
            field = _varint(SPM_TRAINER_SPEC << 3 | 2) + _varint(len(spec)) + spec
        out += field
    return bytes(out)


class BpeTokenizer(Tokenizer):
    """One SentencePiece BPE model for both languages, so embeddings can be shared (§3.4; §5.1 shared vocab).

    Identity normalization and no whitespace collapsing make decode(encode(s)) == s exactly (the default NFKC
    rewrites some characters); byte fallback spells characters never seen in training as UTF-8 byte pieces
    instead of <unk>, so the round trip is exact for any input.
    """

    kind, joint = "bpe", True

    def __init__(self, folder: Path, info: dict):
        super().__init__(folder, info)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.folder / "spm.model"))

    @staticmethod
    def train(folder: Path, cfg: DataConfig, corpus: TrainText, threads: int) -> dict:
        """Learn the merges on at most data.sample_size sentences drawn from both sides (a temp file)."""
        sample = folder / "spm.sample.txt"
        corpus.write_sample(sample, cfg.sample_size, lowercase=cfg.lowercase)
        with open(sample, encoding="utf-8") as f:
            if not any(line.strip() for line in f):
                sample.unlink()
                raise UserError("the training data has no non-blank line: nothing to learn a vocabulary from; "
                                "check the training files of data.train_prefix / data.raw_dir")
        spm.set_random_generator_seed(1)  # shuffle_input_sentence is then reproducible
        try:
            spm.SentencePieceTrainer.train(
                input=str(sample), model_prefix=str(folder / "spm"),
                model_type="bpe", vocab_size=cfg.vocab_size, character_coverage=1.0, byte_fallback=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False, hard_vocab_limit=False,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_piece=SPECIALS[0],
                unk_piece=SPECIALS[1], bos_piece=SPECIALS[2], eos_piece=SPECIALS[3],
                input_sentence_size=cfg.sample_size, shuffle_input_sentence=True, num_threads=threads,
                minloglevel=2)
        except (RuntimeError, ValueError) as e:  # ValueError: a setting it cannot parse (vocab_size >= 2**31)
            raise UserError(f"SentencePiece training failed: {_spm_reason(e)}; try another data.vocab_size") from None
        finally:
            sample.unlink(missing_ok=True)
        model = folder / "spm.model"
        model.write_bytes(_reproducible_spm_model(model.read_bytes()))
        return {"kind": "bpe", "src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang, "lowercase": cfg.lowercase,
                "files": ["spm.model", "spm.vocab"]}

    def vocab_size(self, lang: str) -> int:
        return self.sp.get_piece_size()

    def encode_lines(self, lines: list[str], lang: str) -> list[list[int]]:
        lines = [line.lower() for line in lines] if self.lowercase else lines
        return self.sp.encode(lines, out_type=int, num_threads=self.threads)

    def pieces(self, ids: list[int], lang: str) -> list[str]:
        return [self.sp.id_to_piece(i) for i in ids]

    def decode(self, ids: list[int], lang: str) -> str:
        return self.sp.decode(ids)


def _spm_reason(e: Exception) -> str:
    """SentencePiece's message without its C++ source location and check expression (noise to a user)."""
    text = " ".join(str(e).split())
    return text.rsplit("] ", 1)[-1] if "src/" in text else text


def _spacy_tokenizer(lang: str):
    """spacy.blank(lang).tokenizer, or one line when spaCy lacks the language or its extra packages (ja, ko)."""
    try:
        import spacy  # imported here: a second or two that the bpe path does not need

        return spacy.blank(lang).tokenizer
    except ImportError as e:
        raise UserError(f"data.tokenizer=spacy cannot tokenize language '{lang}': {one_line(e)}") from None


class SpacyTokenizer(Tokenizer):
    """spaCy's rule-based tokenizer spacy.blank(lang), one word vocabulary per language (min_freq, lowercase).

    Word ids keep no record of the original spacing, so hypotheses go back to text with sacremoses'
    MosesDetokenizer(lang): the standard rule set for that (quotes, punctuation, clitics), giving the normal
    running text that sacreBLEU compares with the raw references. spaCy runs in one process (~30k lines/s),
    so data.num_workers only affects SentencePiece.
    """

    kind, joint = "spacy", False

    def __init__(self, folder: Path, info: dict):
        super().__init__(folder, info)
        from sacremoses import MosesDetokenizer

        langs = (self.src_lang, self.tgt_lang)
        self.nlp = {lang: _spacy_tokenizer(lang) for lang in langs}
        self.vocab = {lang: json.loads((self.folder / f"vocab.{lang}.json").read_text("utf-8"))
                      for lang in langs}
        self.index = {lang: {w: i for i, w in enumerate(words)} for lang, words in self.vocab.items()}
        self.detok = {lang: MosesDetokenizer(lang) for lang in langs}

    @staticmethod
    def words(nlp, lines: list[str], lowercase: bool):
        """Token strings per line; whitespace tokens (spaCy keeps runs of extra spaces) are dropped."""
        for doc in nlp.pipe(lines, batch_size=1000):
            yield [t.lower_ if lowercase else t.text for t in doc if not t.is_space]

    @staticmethod
    def train(folder: Path, cfg: DataConfig, corpus: TrainText, threads: int) -> dict:
        langs = (cfg.src_lang, cfg.tgt_lang)
        for lang in langs:
            nlp, counts = _spacy_tokenizer(lang), Counter()
            with _bar(corpus.pairs, f"spacy vocab {lang}") as bar:
                for chunk in _batched(corpus.side(lang), ENCODE_CHUNK):
                    for words in SpacyTokenizer.words(nlp, chunk, cfg.lowercase):
                        counts.update(words)
                    bar.update(len(chunk))
            kept = sorted((w for w, c in counts.items() if c >= cfg.min_freq), key=lambda w: (-counts[w], w))
            _write_json(folder / f"vocab.{lang}.json", [*SPECIALS, *(w for w in kept if w not in SPECIALS)])
        return {"kind": "spacy", "src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang,
                "lowercase": cfg.lowercase, "files": [f"vocab.{lang}.json" for lang in langs]}

    def vocab_size(self, lang: str) -> int:
        return len(self.vocab[lang])

    def encode_lines(self, lines: list[str], lang: str) -> list[list[int]]:
        index = self.index[lang]
        words = self.words(self.nlp[lang], lines, self.lowercase)
        return [[index.get(w, UNK_ID) for w in sentence] for sentence in words]

    def pieces(self, ids: list[int], lang: str) -> list[str]:
        return [self.vocab[lang][i] for i in ids]

    def decode(self, ids: list[int], lang: str) -> str:
        return self.detok[lang].detokenize(self.pieces(ids, lang), unescape=False)


TOKENIZERS = {"bpe": BpeTokenizer, "spacy": SpacyTokenizer}


def _tokenizer_info(folder) -> dict:
    """tokenizer.json of a folder, checked: a known kind, both languages, every file it names present."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"no tokenizer.json in {folder}: need a prepared data folder or RUN_DIR/tokenizer")
    try:
        info = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _damaged_tokenizer(folder, "tokenizer.json is not valid JSON") from None
    if not isinstance(info, dict) or info.get("kind") not in TOKENIZERS:
        kind = info.get("kind") if isinstance(info, dict) else None
        raise _damaged_tokenizer(folder, f"tokenizer.json names no known tokenizer kind ({kind!r})")
    missing = [k for k in ("src_lang", "tgt_lang", "lowercase", "files") if k not in info]
    if missing or not isinstance(info["files"], list):
        raise _damaged_tokenizer(folder, f"tokenizer.json lacks {', '.join(missing) or 'a list of files'}")
    for name in info["files"]:
        if not (Path(folder) / str(name)).is_file():
            raise _damaged_tokenizer(folder, f"{name} is missing")
    return info


def _damaged_tokenizer(folder, what: str) -> UserError:
    """load_tokenizer also reads a run's tokenizer/ folder, which --force does not rebuild."""
    if Path(folder).name == "tokenizer":
        return UserError(f"cannot load the tokenizer in {folder}: damaged ({what}); copy it from the prepared "
                         "data folder the run was trained on")
    return damaged(folder, what)


def load_tokenizer(folder) -> Tokenizer:
    """The tokenizer saved in a prepared data folder or in a run's tokenizer/ folder."""
    info = _tokenizer_info(folder)
    try:
        return TOKENIZERS[info["kind"]](Path(folder), info)
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError) as e:  # truncated spm.model, vocab json that is not JSON, ...
        raise _damaged_tokenizer(folder, one_line(e, 120)) from None


def tokenizer_fingerprint(folder) -> str:
    """sha256 of a saved tokenizer (its settings and files): the trainer stores it in every checkpoint, so a
    tokenizer folder from another run is caught even when its vocabulary has the same size. Preparing the same
    data again gives byte-identical files (_reproducible_spm_model), so a rebuilt prepared folder keeps the
    fingerprint; the bytes are hashed as they are, so runs saved before that keep translating. Also part of the
    cache key of data encoded with a given tokenizer (prepare(..., tokenizer=...))."""
    folder = Path(folder)
    try:
        info = json.loads((folder / "tokenizer.json").read_text("utf-8"))
        digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode())
        for name in info["files"]:
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot load the tokenizer in {folder}: {one_line(e)}") from None
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------- prepare


class TrainText:
    """The training pairs as a stream over the files (never held in memory), blank pairs left out."""

    def __init__(self, src_paths: list[Path], tgt_paths: list[Path], langs: tuple[str, str], pairs: int):
        self.paths, self.langs, self.pairs = (src_paths, tgt_paths), langs, pairs

    def __iter__(self):
        """(index among all lines, src, tgt) of every pair with two non-blank sides."""
        for index, (src, tgt) in enumerate(_line_pairs(self.paths)):
            if src and tgt:
                yield index, src, tgt

    def side(self, lang: str):
        column = 1 + self.langs.index(lang)
        return (item[column] for item in self)

    def write_sample(self, path: Path, size: int, seed: int = 1, lowercase: bool = False) -> int:
        """Write a uniform sample of `size` sentences (both sides pooled) to path, one per line; returns the
        count. SentencePiece then trains on the file rather than on an in-memory list of 9 M sentences."""
        total = 2 * self.pairs  # sentence 2i is the source of line i, 2i + 1 its target
        chosen = np.ones(total, bool)
        if size < total:
            chosen[:] = False
            chosen[np.random.default_rng(seed).choice(total, size, replace=False)] = True
        written = 0
        with open(path, "w", encoding="utf-8") as out, _bar(self.pairs, "sample for the tokenizer") as bar:
            for index, src, tgt in self:
                for sentence, pick in ((src, chosen[2 * index]), (tgt, chosen[2 * index + 1])):
                    if pick:
                        out.write((sentence.lower() if lowercase else sentence) + "\n")
                        written += 1
                bar.update(1)
        return written


_WORKER: dict = {}  # each encoding process's tokenizer and languages, set once by _init_worker


def _init_worker(folder: str, langs: tuple[str, str]) -> None:
    tok = load_tokenizer(folder)
    tok.threads = 1  # parallelism comes from the processes
    _WORKER.update(tok=tok, langs=langs)


def _encode_chunk(pairs: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src ids with an eos after each sentence, src lengths incl. eos, tgt ids, tgt lengths) of a chunk."""
    tok, (src_lang, tgt_lang) = _WORKER["tok"], _WORKER["langs"]
    src = tok.encode_lines([s for s, _ in pairs], src_lang)
    tgt = tok.encode_lines([t for _, t in pairs], tgt_lang)
    src_len = np.fromiter(map(len, src), np.int64, count=len(src)) + 1
    tgt_len = np.fromiter(map(len, tgt), np.int64, count=len(tgt))
    src_flat = np.fromiter(itertools.chain.from_iterable(ids + [EOS_ID] for ids in src), np.int32, int(src_len.sum()))
    tgt_flat = np.fromiter(itertools.chain.from_iterable(tgt), np.int32, int(tgt_len.sum()))
    return src_flat, src_len, tgt_flat, tgt_len


def _encode_stream(chunks, folder: Path, langs: tuple[str, str], workers: int):
    """(chunk, encoded chunk) in input order. With workers > 1 a process pool encodes, at most 2 chunks per
    worker in flight, so memory stays bounded however long the corpus (Pool.imap would read it all ahead)."""
    if workers <= 1:
        _init_worker(str(folder), langs)
        for chunk in chunks:
            yield chunk, _encode_chunk(chunk)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")  # fork: no re-imports
    with context.Pool(workers, initializer=_init_worker, initargs=(str(folder), langs)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def _to_npy(raw: Path, npy: Path, dtype, count: int) -> None:
    """Turn a raw file of count dtype values into a .npy, copying in slices (no whole array in memory)."""
    out = np.lib.format.open_memmap(npy, mode="w+", dtype=dtype, shape=(count,))
    if count:
        data = np.memmap(raw, dtype=dtype, mode="r", shape=(count,))
        for i in range(0, count, 1 << 24):
            out[i : i + (1 << 24)] = data[i : i + (1 << 24)]
        del data
    out.flush()
    del out
    raw.unlink()


def _line_pairs(sides) -> Iterator[tuple[str, str]]:
    """(src, tgt) of every line of a split whose sides are lists of files read one after the other."""
    for src, tgt in zip(*sides, strict=True):
        yield from zip(iter_lines(src), iter_lines(tgt), strict=True)


def _encode_split(cfg: DataConfig, folder: Path, split: str, sides: list[list[Path]], lines: int,
                  dtype, workers: int) -> dict:
    """Encode one split chunk by chunk, appending the token ids to raw files (then .npy) as they come.

    Training pairs are cleaned (blank, longer than max_len, length ratio above max_len_ratio); valid/test
    splits are kept whole, with their raw text for BLEU.
    """
    langs, train = (cfg.src_lang, cfg.tgt_lang), split == "train"
    stats = {"lines": lines, "blank": 0, "too_long": 0, "bad_ratio": 0}
    passes = 2 if train and cfg.bidirectional else 1
    lengths, tokens, unks = {"src": [], "tgt": []}, {"src": 0, "tgt": 0}, {"src": 0, "tgt": 0}
    seen = 0  # pairs read (blank training pairs excluded)
    raw = {side: open(folder / f"{split}.{side}.tokens.bin", "wb") for side in ("src", "tgt")}
    text = {} if train else {lang: open(folder / f"{split}.{lang}.txt", "w", encoding="utf-8") for lang in langs}
    if train:  # blank pairs left out (counted below)
        pairs = ((src, tgt) for _, src, tgt in TrainText(*sides, langs, lines))
        if passes == 2:  # then every pair reversed: the source's language alone says which way to translate
            back = ((tgt, src) for _, src, tgt in TrainText(*sides, langs, lines))
            pairs = itertools.chain(pairs, back)
    else:
        pairs = _line_pairs(sides)
    chunks = _batched(pairs, ENCODE_CHUNK)
    desc = f"encode {split} ({workers} process{'es' * (workers > 1)})"
    try:
        with _bar(passes * lines, desc) as bar:
            for chunk, (src_flat, src_len, tgt_flat, tgt_len) in _encode_stream(chunks, folder, langs, workers):
                keep = np.ones(len(chunk), bool)
                if train:  # usual corpus cleaning; never applied to valid/test (the BLEU references)
                    ls, lt = src_len - 1, tgt_len
                    too_long = (ls > cfg.max_len) | (lt > cfg.max_len)
                    ratio = np.maximum(ls, lt) / np.maximum(np.minimum(ls, lt), 1)
                    bad_ratio = ~too_long & (ratio > cfg.max_len_ratio)
                    keep = ~(too_long | bad_ratio)
                    stats["too_long"] += int(too_long.sum())
                    stats["bad_ratio"] += int(bad_ratio.sum())
                else:
                    for lang, column in zip(langs, zip(*chunk, strict=True), strict=True):
                        text[lang].write("".join(f"{line}\n" for line in column))
                for side, flat, length in (("src", src_flat, src_len), ("tgt", tgt_flat, tgt_len)):
                    kept = flat[np.repeat(keep, length)].astype(dtype)
                    kept.tofile(raw[side])
                    lengths[side].append(length[keep])
                    tokens[side] += len(kept)
                    unks[side] += int(np.count_nonzero(kept == UNK_ID))
                bar.update(len(chunk))
                seen += len(chunk)
    finally:
        for handle in (*raw.values(), *text.values()):
            handle.close()
    for side in ("src", "tgt"):
        length = np.concatenate(lengths[side]) if lengths[side] else np.zeros(0, np.int64)
        offsets = np.zeros(len(length) + 1, np.int64)
        np.cumsum(length, out=offsets[1:])
        np.save(folder / f"{split}.{side}.offsets.npy", offsets)
        _to_npy(folder / f"{split}.{side}.tokens.bin", folder / f"{split}.{side}.tokens.npy", dtype, tokens[side])
    pairs_kept = len(offsets) - 1
    src_text = tokens["src"] - pairs_kept  # text tokens: the eos of each source is not counted
    if train:  # the reversed pass drops the same pairs again: count them once
        stats = {"lines": lines, "blank": lines - seen // passes, "too_long": stats["too_long"] // passes,
                 "bad_ratio": stats["bad_ratio"] // passes}
    else:
        stats = {"lines": lines}
    return {**stats, "pairs": pairs_kept, "src_tokens": src_text, "tgt_tokens": tokens["tgt"],
            "src_unk_rate": unks["src"] / max(src_text, 1), "tgt_unk_rate": unks["tgt"] / max(tokens["tgt"], 1)}


def _cache_key(cfg: DataConfig, files: dict, tokenizer: Path | None = None) -> tuple[dict, dict, str]:
    """Settings that change the output, input checksums, and a short hash of both that names the folder.
    With a given tokenizer its fingerprint is a setting too: the same text encoded with another tokenizer is
    other data. Without one the key is what it always was, so existing prepared folders stay valid."""
    settings = {"dataset": cfg.dataset, "src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang,
                "tokenizer": cfg.tokenizer, "max_len": cfg.max_len, "max_len_ratio": cfg.max_len_ratio,
                "splits": list(files)}
    if cfg.tokenizer == "bpe":
        settings.update(vocab_size=cfg.vocab_size, sample_size=cfg.sample_size)
        if cfg.lowercase:  # only when on, so the folders prepared before the option keep their key
            settings.update(lowercase=True)
    else:
        settings.update(min_freq=cfg.min_freq, lowercase=cfg.lowercase)
    if cfg.bidirectional:  # only when on, so the folders prepared before the option keep their key
        settings.update(bidirectional=True)
    if tokenizer is not None:
        settings.update(tokenizer_sha256=tokenizer_fingerprint(tokenizer))
    cache_file = Path(cfg.prepared_dir) / "input_sha256.json"  # sums of big inputs, by path, size and mtime
    try:
        cache = json.loads(cache_file.read_text("utf-8")) if cache_file.is_file() else {}
    except (UnicodeDecodeError, ValueError):  # only a cache (e.g. cut short by a full disk): compute it again
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    inputs, known = {}, len(cache)
    for split, sides in files.items():
        for lang, value in sides.items():
            paths = file_list(value)
            for path in paths:
                name = f"{split}.{lang}" if len(paths) == 1 else f"{split}.{lang}.{path.name}"
                big = path.stat().st_size >= BIG_FILE
                inputs[name] = {"path": str(path), "sha256": _sha256_file(path, cache if big else None)}
    if len(cache) > known:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        _write_json(cache_file, cache)
    sums = {name: v["sha256"] for name, v in inputs.items()}
    blob = json.dumps([FORMAT_VERSION, settings, sums], sort_keys=True).encode()
    key = hashlib.sha256(blob).hexdigest()[:10]
    return settings, inputs, key


def prepare(cfg: DataConfig, force: bool = False, tokenizer: Path | None = None) -> Path:
    """The folder for cfg: reused when complete (has meta.json), else built aside and renamed in place.

    tokenizer: a saved tokenizer folder (RUN_DIR/tokenizer) to encode with, copied into the folder, instead of
    training one on the data: a fine-tuned model (train.init_from) must read the ids it was trained on."""
    start = time.time()
    if cfg.dataset not in DATASETS:
        raise UserError(f"data.dataset '{cfg.dataset}' is unknown; use {', '.join(DATASETS)}")
    if cfg.tokenizer not in TOKENIZERS:
        raise UserError(f"data.tokenizer '{cfg.tokenizer}' is unknown; use {', '.join(TOKENIZERS)}")
    files = DATASETS[cfg.dataset](cfg)
    settings, inputs, key = _cache_key(cfg, files, tokenizer)
    _check_distinct_splits(files, inputs)
    vocab = (f"{cfg.vocab_size}" if cfg.tokenizer == "bpe" else f"-min{cfg.min_freq}") + "-lc" * cfg.lowercase
    name = f"{cfg.dataset}_{cfg.src_lang}-{cfg.tgt_lang}_{cfg.tokenizer}{vocab}_{key}"
    folder = Path(cfg.prepared_dir) / name
    if (folder / "meta.json").is_file() and not force:
        check_prepared(folder)
        print(f"using prepared data {folder} (--force rebuilds it)")
        return folder
    tmp = temp_path(folder)  # a whole folder built aside, renamed when complete
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"data.prepared_dir {folder.parent} is not a writable folder: {e.strerror or e}") from None
    try:
        meta = _build(cfg, files, tmp, tokenizer)
        meta.update(settings=settings, inputs=inputs, seconds=round(time.time() - start, 1))
        _write_json(tmp / "meta.json", meta)  # last: a folder with meta.json is complete
        if force or not (folder / "meta.json").is_file():  # else another process (a second rank) was quicker
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_summary(meta, folder)
    return folder


def _check_distinct_splits(files: dict, inputs: dict) -> None:
    """Validation or test text identical to the training text (the same file given twice, or a copy) would
    silently measure memorization: refuse it."""
    sha = {v["path"]: v["sha256"] for v in inputs.values()}

    def sums(split):
        return [sha[str(path)] for side in files[split].values() for path in file_list(side)]

    empty = hashlib.sha256(b"").hexdigest()  # no training text is reported later, by its own check
    for split in files:
        if split != "train" and sums(split) == sums("train") and set(sums("train")) != {empty}:
            raise UserError(f"split '{split}' has the same text as the training split: validating or testing on "
                            "training data measures nothing; give other files")


def check_prepared(folder: Path) -> None:
    """What reusing a prepared folder needs, checked cheaply (headers and sizes, no token read): meta.json, the
    tokenizer (loaded, as its user will next), every split's arrays and the valid/test raw text. Raises
    damaged(...) otherwise."""
    meta = load_meta(folder)
    load_tokenizer(folder)
    for split in meta["splits"]:
        load_split(folder, split)
        if split != "train":
            for lang in (meta["src_lang"], meta["tgt_lang"]):
                if not (folder / f"{split}.{lang}.txt").is_file():
                    raise damaged(folder, f"{split}.{lang}.txt is missing")


def _build(cfg: DataConfig, files: dict, folder: Path, tokenizer: Path | None = None) -> dict:
    """Count, tokenize, filter and store every split into folder, streaming; returns the meta.json content.
    The tokenizer is trained on the training split, or copied from the folder `tokenizer` when given."""
    langs = (cfg.src_lang, cfg.tgt_lang)
    sides, counts = {}, {}
    for split, paths in files.items():  # line counts first: a misaligned file fails now, not after an hour
        sides[split] = [file_list(paths[lang]) for lang in langs]
        counts[split] = 0
        for src, tgt in zip(*sides[split], strict=True):
            n_src, n_tgt = count_lines(src), count_lines(tgt)
            if n_src != n_tgt:
                raise UserError(f"{split}: {src} has {n_src} lines but {tgt} has {n_tgt}; the two sides must be "
                                f"line-aligned")
            expected = WMT14_LINES.get(wmt14_corpus(src)) if cfg.dataset == "wmt14" else None
            if expected is not None and n_src != expected:
                print(f"warning: {src} has {n_src} lines; the published WMT14 file has {expected}")
            counts[split] += n_src
    workers = cfg.num_workers or min(os.cpu_count() or 1, 8)
    if tokenizer is None:
        corpus = TrainText(*sides["train"], langs, counts["train"])
        print(f"training the {cfg.tokenizer} tokenizer on {counts['train']} training lines", flush=True)
        info = TOKENIZERS[cfg.tokenizer].train(folder, cfg, corpus, workers)
        _write_json(folder / "tokenizer.json", info)
    else:
        print(f"encoding with the tokenizer in {tokenizer} (not training one)", flush=True)
        load_tokenizer(tokenizer).save(folder)  # the same bytes, so the same fingerprint
    tok = load_tokenizer(folder)
    dtype = np.uint16 if max(tok.src_vocab_size, tok.tgt_vocab_size) <= 1 << 16 else np.int32
    splits = {}
    for split in files:
        parallel = workers if counts[split] > ENCODE_CHUNK else 1  # a pool costs more than a small split
        splits[split] = _encode_split(cfg, folder, split, sides[split], counts[split], dtype, parallel)
    return {"format": FORMAT_VERSION, "dataset": cfg.dataset, "src_lang": langs[0], "tgt_lang": langs[1],
            "tokenizer": cfg.tokenizer, "joint": tok.joint, "src_vocab_size": tok.src_vocab_size,
            "tgt_vocab_size": tok.tgt_vocab_size, "dtype": np.dtype(dtype).name,
            "valid_split": cfg.valid_split, "bidirectional": cfg.bidirectional,
            "test_splits": [s for s in files if s not in ("train", cfg.valid_split)], "splits": splits}


def print_summary(meta: dict, folder: Path) -> None:
    """Pairs, tokens, mean lengths and <unk> rates per split, vocabulary sizes, time taken."""
    src, tgt = meta["src_lang"], meta["tgt_lang"]
    vocab = (f"joint vocabulary {meta['src_vocab_size']}" if meta["joint"] else
             f"vocabularies {src} {meta['src_vocab_size']}, {tgt} {meta['tgt_vocab_size']}")
    print(f"prepared {meta['dataset']} {meta['src_lang']}-{meta['tgt_lang']} ({meta['tokenizer']}, {vocab}) "
          f"in {meta['seconds']:.1f} s -> {folder}")
    print(f"{'split':<18}{'pairs':>8}{'src tokens':>12}{'tgt tokens':>12}{'src len':>9}{'tgt len':>9}"
          f"{'src unk':>9}{'tgt unk':>9}")
    for name, s in meta["splits"].items():
        n = max(s["pairs"], 1)
        print(f"{name:<18}{s['pairs']:>8}{s['src_tokens']:>12}{s['tgt_tokens']:>12}"
              f"{s['src_tokens'] / n:>9.1f}{s['tgt_tokens'] / n:>9.1f}"
              f"{s['src_unk_rate']:>9.2%}{s['tgt_unk_rate']:>9.2%}")
    t = meta["splits"]["train"]
    print(f"train: {t['lines']} lines, skipped {t['blank']} blank, dropped {t['too_long']} longer than "
          f"{meta['settings']['max_len']} tokens and {t['bad_ratio']} with length ratio > "
          f"{meta['settings']['max_len_ratio']}")
    if meta.get("bidirectional"):
        print(f"train holds each kept pair twice, {src}->{tgt} and {tgt}->{src}; valid/test are {src}->{tgt} only")


# ------------------------------------------------------------------------------------------------ reading


class Split:
    """One encoded split, memory-mapped: all sentences back to back plus n+1 offsets per side.

    src_lengths count the eos (what the encoder reads); tgt_lengths count the text tokens only, since
    collate adds the bos (decoder input) and the eos (decoder output).
    """

    def __init__(self, name: str, src_tokens: np.ndarray, src_offsets: np.ndarray, tgt_tokens: np.ndarray,
                 tgt_offsets: np.ndarray):
        self.name = name
        self.src_tokens, self.src_offsets = src_tokens, src_offsets
        self.tgt_tokens, self.tgt_offsets = tgt_tokens, tgt_offsets
        self.src_lengths, self.tgt_lengths = np.diff(self.src_offsets), np.diff(self.tgt_offsets)

    @classmethod
    def load(cls, folder: Path, name: str) -> Split:
        """The split as prepared, memory-mapped (load_split checks it against meta.json)."""
        load = lambda part: np.load(folder / f"{name}.{part}.npy", mmap_mode="r")  # noqa: E731
        return cls(name, load("src.tokens"), load("src.offsets"), load("tgt.tokens"), load("tgt.offsets"))

    def texts(self, tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
        """The (source, target) sentences again: a BPE tokenizer decodes its ids back to the exact input text."""
        src = [tokenizer.decode(self.src_tokens[a : b - 1].tolist(), tokenizer.src_lang)  # b - 1: drop the eos
               for a, b in zip(self.src_offsets[:-1], self.src_offsets[1:], strict=True)]
        tgt = [tokenizer.decode(self.tgt_tokens[a:b].tolist(), tokenizer.tgt_lang)
               for a, b in zip(self.tgt_offsets[:-1], self.tgt_offsets[1:], strict=True)]
        return src, tgt

    def __len__(self) -> int:
        return len(self.src_lengths)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids ending in eos, target ids without bos/eos) of pair i."""
        s, t = self.src_offsets, self.tgt_offsets
        return self.src_tokens[s[i] : s[i + 1]], self.tgt_tokens[t[i] : t[i + 1]]


META_KEYS = ("format", "src_lang", "tgt_lang", "src_vocab_size", "tgt_vocab_size", "dtype", "valid_split",
             "test_splits", "splits")


def load_meta(folder) -> dict:
    """meta.json of a prepared folder: vocab sizes, split names (valid_split, test_splits), counts, inputs."""
    path = Path(folder) / "meta.json"
    if not path.is_file():
        raise UserError(f"{folder} is not a prepared data folder (no meta.json): run data_preparation.py")
    try:
        meta = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise damaged(folder, "meta.json is not valid JSON") from None
    if not isinstance(meta, dict) or any(key not in meta for key in META_KEYS):
        raise damaged(folder, "meta.json lacks entries")
    if meta["format"] != FORMAT_VERSION:
        raise damaged(folder, f"meta.json has format {meta['format']}, this code reads {FORMAT_VERSION}")
    if not isinstance(meta["splits"], dict) or not all(isinstance(s, dict) and isinstance(s.get("pairs"), int)
                                                       for s in meta["splits"].values()):
        raise damaged(folder, "meta.json lacks the pair counts of its splits")
    return meta


def load_split(prepared_dir, split: str) -> Split:
    """One split, checked against meta.json: arrays present, whole, of the recorded dtype and pair count."""
    meta = load_meta(prepared_dir)
    splits = meta["splits"]
    if split not in splits:
        raise UserError(f"no split '{split}' in {prepared_dir}; it has {', '.join(splits)}")
    try:
        data = Split.load(Path(prepared_dir), split)
    except FileNotFoundError as e:
        raise damaged(prepared_dir, f"{Path(e.filename).name} is missing") from None
    except (OSError, ValueError, EOFError) as e:  # np.load of a truncated or overwritten .npy
        raise damaged(prepared_dir, f"an array of split '{split}' is unreadable: {one_line(e, 100)}") from None
    for side in ("src", "tgt"):
        tokens, offsets = getattr(data, f"{side}_tokens"), getattr(data, f"{side}_offsets")
        whole = (offsets.ndim == 1 and len(offsets) == splits[split]["pairs"] + 1 and offsets[0] == 0
                 and offsets[-1] == len(tokens) and tokens.dtype.name == meta["dtype"])
        if not whole:
            raise damaged(prepared_dir, f"{split}.{side} arrays do not match meta.json")
    return data


def read_raw(prepared_dir, split: str, lang: str) -> list[str]:
    """Lines of a valid/test split as read from the input (BLEU references), surrounding spaces stripped."""
    path = Path(prepared_dir) / f"{split}.{lang}.txt"
    if not path.is_file():
        raise UserError(f"no raw text {path.name} in {prepared_dir}: only valid and test splits keep it")
    return path.read_text("utf-8").split("\n")[:-1]


def _round_up(n, multiple: int):
    return (n + multiple - 1) // multiple * multiple


def collate(split: Split, indices, pad_id: int = PAD_ID, pad_multiple: int = 8):
    """Pad a batch: src (B,S) = tokens+eos, tgt_in (B,T) = bos+tokens, tgt_out (B,T) = tokens+eos.

    S and T are rounded up to pad_multiple: fewer distinct shapes (torch.compile) and tensor-core sizes.
    """
    pairs = [split.pair(int(i)) for i in indices]
    S = _round_up(max(len(s) for s, _ in pairs), pad_multiple)
    T = _round_up(max(len(t) for _, t in pairs) + 1, pad_multiple)
    src = np.full((len(pairs), S), pad_id, np.int64)
    tgt_in = np.full((len(pairs), T), pad_id, np.int64)
    tgt_out = tgt_in.copy()
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)] = s
        tgt_in[row, 0], tgt_in[row, 1 : len(t) + 1] = BOS_ID, t
        tgt_out[row, : len(t)], tgt_out[row, len(t)] = t, EOS_ID
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


class TokenBatchSampler:
    """Batches of at most max_tokens padded tokens (§5.1: batches of "approximately 25000" tokens per side).

    Pairs are sorted by their padded cost max(S, T) as collate pads them (then src length, tgt length and a
    random tiebreak drawn from (seed, epoch)), so a growing batch costs size x the cost of its last pair and
    consecutive pairs are packed while that stays <= max_tokens. A single pair costing more than max_tokens
    gets a batch of its own (data.max_len filters training data so that this does not happen). The boundaries
    depend only on the sorted costs, so they are computed once; each epoch redraws the tiebreak and the batch
    order from (seed, epoch). With world_size ranks the largest batches are halved until the count divides
    evenly, and rank r takes batches r, r + world_size, ...: same count per rank, every pair once per epoch.
    iter_from(k) resumes an epoch at batch k (exact resume from a checkpoint).
    """

    def __init__(self, src_lengths, tgt_lengths, max_tokens: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, pad_multiple: int = 8):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.max_tokens, self.shuffle, self.seed, self.pad_multiple = max_tokens, shuffle, seed, pad_multiple
        self.rank, self.world_size, self.epoch = rank, world_size, 0
        src = np.asarray(src_lengths, np.int64)
        tgt = np.asarray(tgt_lengths, np.int64)
        # tgt + 1: collate adds bos to the decoder input and eos to its output
        self.cost = np.maximum(_round_up(src, pad_multiple), _round_up(tgt + 1, pad_multiple))
        cost_rank = np.unique(self.cost, return_inverse=True)[1].astype(np.int64)
        # one int64 sort key: cost rank | src | tgt | 15 bits of tiebreak (a lexsort would be 4x slower)
        self._key = (cost_rank << 47) | (np.minimum(src, 0xFFFF) << 31) | (np.minimum(tgt, 0xFFFF) << 15)
        self._bounds = self._pack(np.sort(self.cost))
        while len(self._bounds) % world_size:
            i = max(range(len(self._bounds)), key=lambda j: self._bounds[j][1] - self._bounds[j][0])
            a, b = self._bounds[i]
            if b - a < 2:
                raise UserError(f"cannot give {world_size} ranks equally many batches from {len(src)} pairs")
            self._bounds[i : i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]

    def _pack(self, costs: np.ndarray) -> list[tuple[int, int]]:
        """Greedy packing of sorted costs; one numpy window per batch, not a Python loop over pairs."""
        bounds, start = [], 0
        while start < len(costs):
            window = costs[start : start + max(1, self.max_tokens // int(costs[start]))]
            size = max(1, int(np.count_nonzero(window * np.arange(1, len(window) + 1) <= self.max_tokens)))
            bounds.append((start, start + size))
            start += size
        return bounds

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def with_lengths(self, src_lengths, tgt_lengths) -> TokenBatchSampler:
        """The same sampler (settings and epoch) over other pairs, e.g. the training pairs segmented anew."""
        sampler = TokenBatchSampler(src_lengths, tgt_lengths, self.max_tokens, self.shuffle, self.seed, self.rank,
                                    self.world_size, self.pad_multiple)
        sampler.set_epoch(self.epoch)
        return sampler

    def __len__(self) -> int:
        return len(self._bounds) // self.world_size

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, start_batch: int):
        """This rank's batches of the current epoch (lists of pair indices), from batch start_batch on."""
        rng = np.random.default_rng([self.seed, self.epoch])
        key = self._key | rng.integers(0, 1 << 15, len(self._key)) if self.shuffle else self._key
        order = np.argsort(key, kind="stable")
        batches = [order[a:b] for a, b in self._bounds]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        for batch in batches[self.rank :: self.world_size][start_batch:]:
            yield batch.tolist()


class BpeMerges:
    """SentencePiece's BPE encoding, run on every word of a corpus at once in numpy, with BPE-dropout.

    Encoding starts from characters (a character outside the vocabulary: its UTF-8 byte pieces) and, in each word
    (a "\u2581" starts one), merges the adjacent pair whose concatenation is the piece of highest score, the
    leftmost on a tie, until no pair makes a piece: what SentencePiece does (equal ids, tested). With dropout p,
    each candidate pair of a step is skipped with probability p and a word whose candidates are all skipped stops
    there (Provilkov et al. 2020, Algorithm 1). Why not SentencePiece's own sampling: with a fixed seed it still
    gave other pieces in each new process (sentencepiece 0.2.3), and an exact resume or DDP ranks need the same."""

    def __init__(self, sp: spm.SentencePieceProcessor):
        self.sp, n = sp, sp.get_piece_size()
        ids = {sp.id_to_piece(i): i for i in range(n) if not (sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i))}
        pairs = [(left * n + ids[piece[k:]], i, sp.get_score(i)) for piece, i in ids.items()
                 for k in range(1, len(piece)) if (left := ids.get(piece[:k])) is not None and piece[k:] in ids]
        pairs.sort()
        self.keys = np.array([p[0] for p in pairs], np.int64)  # left id * n + right id, ascending
        self.merged = np.array([p[1] for p in pairs], np.int32)
        self.score = np.array([p[2] for p in pairs], np.float32)
        self.ids, self.n = ids, n

    def chars(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The encoding's start: symbol ids (N,) of all lines back to back, and the line of each symbol (N,)."""
        cache: dict[str, list[int]] = {}
        def char_ids(c: str) -> list[int]:
            if c not in cache:
                cache[c] = [self.ids[c]] if c in self.ids else [self.sp.piece_to_id(f"<0x{b:02X}>") for b in c.encode()]
            return cache[c]
        rows = [[i for c in ("\u2581" + line.replace(" ", "\u2581") if line else "") for i in char_ids(c)]
                for line in lines]
        lengths = np.array([len(r) for r in rows], np.int64)
        return (np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lengths.sum())),
                np.repeat(np.arange(len(rows)), lengths))

    def reachable(self, lines: list[str]) -> np.ndarray:
        """Every piece that is a substring of a word of lines (ascending ids): a superset of the pieces BPE-dropout
        can cut them into, which stay inside words (Multi30k German: 5693, against 5316 without dropout and 5638
        seen in 10 epochs of dropout 0.1)."""
        words = {w for line in lines for w in ("\u2581" + line.replace(" ", " \u2581")).split(" ")}
        found = {self.ids.get(w[a:b]) for w in words for a in range(len(w)) for b in range(a + 1, len(w) + 1)}
        return np.array(sorted(found - {None}), np.int64)

    def encode(self, symbols: np.ndarray, line: np.ndarray, n_lines: int, dropout: float = 0.0,
               rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """chars() -> (tokens (M,), offsets (n_lines+1,)): every line's pieces back to back."""
        space = self.ids.get("\u2581", -1)
        word = np.cumsum((symbols == space) | np.r_[True, line[1:] != line[:-1]])  # (N,) word number
        where = np.arange(len(symbols))  # a symbol's first character: the order to put finished words back in
        finished: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while len(symbols):
            key = symbols[:-1].astype(np.int64) * self.n + symbols[1:]
            slot = np.minimum(np.searchsorted(self.keys, key), len(self.keys) - 1)
            at = np.flatnonzero((self.keys[slot] == key) & (word[:-1] == word[1:]))  # pairs that make a piece
            if dropout > 0:
                at = at[rng.random(len(at)) >= dropout]
            merged = np.zeros(int(word[-1]) + 1, bool)
            if len(at):
                w, score = word[at], self.score[slot[at]]
                starts = np.flatnonzero(np.r_[True, w[1:] != w[:-1]])  # at is ascending: each word is one run
                best = np.repeat(np.maximum.reduceat(score, starts), np.diff(np.r_[starts, len(at)]))
                top = at[score == best]
                top = top[np.r_[True, word[top[1:]] != word[top[:-1]]]]  # the leftmost best pair of each word
                symbols[top] = self.merged[slot[top]]
                merged[word[top]] = True
                keep = np.ones(len(symbols), bool)
                keep[top + 1] = False
                symbols, word, line, where = symbols[keep], word[keep], line[keep], where[keep]
            # A word without a merge this step is final: no pair makes a piece, or dropout skipped them all.
            going = merged[word]
            finished.append((symbols[~going], line[~going], where[~going]))
            symbols, word, line, where = symbols[going], word[going], line[going], where[going]
        parts = finished or [(symbols, line, where)]  # no symbol at all: nothing finished
        symbols, line, where = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        order = np.argsort(where, kind="stable")
        offsets = np.zeros(n_lines + 1, np.int64)
        np.cumsum(np.bincount(line, minlength=n_lines), out=offsets[1:])
        return symbols[order], offsets


class BpeDropout:
    """The training pairs cut into pieces anew for each epoch by BPE-dropout (Provilkov et al. 2020): a word
    seen in many segmentations teaches the model how its pieces compose. Both sides, as in the paper; the text
    comes back from the prepared ids (BPE decodes exactly), so the prepared data stay as they are."""

    def __init__(self, split: Split, tokenizer: BpeTokenizer, dropout: float, seed: int):
        self.dropout, self.seed = dropout, seed
        self.src_text, self.tgt_text = split.texts(tokenizer)
        self.bpe = BpeMerges(tokenizer.sp)
        self.src_chars, self.tgt_chars = self.bpe.chars(self.src_text), self.bpe.chars(self.tgt_text)

    def __call__(self, epoch: int) -> Split:
        """This epoch's segmentation: the same on every rank, and again when a run resumes in this epoch."""
        rng, n = np.random.default_rng([self.seed, epoch]), len(self.src_text)
        src, src_offsets = self.bpe.encode(*(a.copy() for a in self.src_chars), n, self.dropout, rng)
        tgt, tgt_offsets = self.bpe.encode(*(a.copy() for a in self.tgt_chars), n, self.dropout, rng)
        # the eos that ends each source: one more slot per line
        src_eos = np.insert(src, src_offsets[1:], EOS_ID)
        return Split(f"train (BPE-dropout, epoch {epoch + 1})", src_eos, src_offsets + np.arange(n + 1), tgt,
                     tgt_offsets)


def drop_source_tokens(src: torch.Tensor, p: float, rng: np.random.Generator, pad_id: int = PAD_ID) -> torch.Tensor:
    """Token Drop (Zhang et al. 2020, without its two auxiliary losses): each source piece becomes <unk> with
    probability p, so no translation can lean on one source piece alone; eos and padding stay. src (B,S)."""
    hit = torch.from_numpy(rng.random(tuple(src.shape)) < p) & src.ne(pad_id) & src.ne(EOS_ID)
    return src.masked_fill(hit, UNK_ID)


class BatchStream:
    """The training batches, epoch after epoch, and their position (epoch, batch_in_epoch) for an exact resume:
    iterating continues from that position, so a resumed run reads the same batches in the same order.

    resegment: epoch -> that epoch's training pairs (BpeDropout), batched by a sampler over their lengths.
    src_token_drop: drop_source_tokens' p, its draws a function of (seed, rank, epoch, batch), so a resumed run
    drops the same pieces."""

    def __init__(self, split: Split, sampler: TokenBatchSampler, pad_id: int, pad_multiple: int, max_epochs: int = 0,
                 resegment: Callable[[int], Split] | None = None, src_token_drop: float = 0.0):
        self.split, self.sampler, self.pad_id, self.pad_multiple = split, sampler, pad_id, pad_multiple
        self.max_epochs, self.resegment = max_epochs, resegment  # max_epochs 0 = endless
        self.src_token_drop = src_token_drop
        self.epoch, self.batch_in_epoch = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(src, tgt_in, tgt_out) batches on the CPU; ends after max_epochs epochs."""
        while True:
            if self.resegment is not None:
                self.split = self.resegment(self.epoch)
                self.sampler = self.sampler.with_lengths(self.split.src_lengths, self.split.tgt_lengths)
            self.sampler.set_epoch(self.epoch)
            order = list(self.sampler)
            while self.batch_in_epoch < len(order):
                indices = order[self.batch_in_epoch]
                src, tgt_in, tgt_out = collate(self.split, indices, self.pad_id, self.pad_multiple)
                if self.src_token_drop:
                    rng = np.random.default_rng([self.sampler.seed, self.sampler.rank, self.epoch, self.batch_in_epoch])
                    src = drop_source_tokens(src, self.src_token_drop, rng, self.pad_id)
                self.batch_in_epoch += 1
                yield src, tgt_in, tgt_out
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            if self.max_epochs and self.epoch >= self.max_epochs:
                return


# ------------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="data_preparation.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download (Multi30k) or read a parallel corpus, train the tokenizer, encode the splits.\n"
        "The result is a folder under data.prepared_dir, reused until the inputs or data settings change.",
        epilog="examples:\n  python data_preparation.py --config configs/multi30k_en_de.yaml\n"
        "  python data_preparation.py --config configs/multi30k_en_de.yaml data.tokenizer=spacy --force\n\n"
        "--debug shows tracebacks; NMT_DOWNLOAD_URL_BASE=URL fetches Multi30k from a mirror (file:// works).")
    parser.add_argument("--config", required=True, help="YAML config: its data section; train.max_tokens, pad_multiple")
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching folder exists")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, e.g. data.vocab_size=16000")
    args = parser.parse_intermixed_args(argv)  # overrides before and after --force
    cfg = load_config(args.config, args.overrides)
    folder = prepare(cfg.data, force=args.force)
    train = load_split(folder, "train")
    t = cfg.train  # the trainer's own batching: padding to pad_multiple counts against max_tokens
    sampler = TokenBatchSampler(train.src_lengths, train.tgt_lengths, t.max_tokens, seed=t.seed,
                                pad_multiple=t.pad_multiple)
    print(f"train: {len(sampler)} batches per epoch at train.max_tokens={t.max_tokens}, "
          f"train.pad_multiple={t.pad_multiple}")
    return folder


if __name__ == "__main__":
    cli_main(main)
