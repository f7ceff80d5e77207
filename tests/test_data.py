"""Tests of data_preparation.py: fixture corpus, batching, downloads, Multi30k (MULTI30K_DIR), the CLI."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import urllib.error

import numpy as np
import pytest
import torch
from conftest import (
    FIXTURES,
    finish,
    fixture_config,
    fixture_data,
    fixture_lines,
    multi30k_dir,
    start_script,
    write_config,
    write_corpus,
)

import corpora
import data_preparation as dp
from config import DataConfig
from runtime import UserError

MULTI30K_SIZES = {"train": 29000, "val": 1014, "test_2016_flickr": 1000, "test_2017_flickr": 1000,
                  "test_2017_mscoco": 461}


@pytest.fixture(scope="session")
def fixture_prepared(tmp_path_factory):
    """The fixture corpus prepared once per session with each tokenizer."""
    root = tmp_path_factory.mktemp("fixture_prepared")
    return {kind: dp.prepare(fixture_config(root, tokenizer=kind)) for kind in ("bpe", "spacy")}


@pytest.fixture(scope="session")
def multi30k_prepared(tmp_path_factory):
    """Multi30k en-de prepared once per session with each tokenizer (default settings)."""
    raw = multi30k_dir()
    if raw is None:
        pytest.skip("real-data test: set MULTI30K_DIR to the Multi30k raw folder")
    root = tmp_path_factory.mktemp("multi30k_prepared")
    return {kind: dp.prepare(DataConfig(raw_dir=str(raw), prepared_dir=str(root), tokenizer=kind))
            for kind in ("bpe", "spacy")}


def read_meta(folder) -> dict:
    return json.loads((folder / "meta.json").read_text("utf-8"))


# ------------------------------------------------------------------------------------- fixture corpus


def test_bpe_round_trip_specials_and_eos_conventions(fixture_prepared):
    tok = dp.load_tokenizer(fixture_prepared["bpe"])
    assert tok.joint and tok.src_vocab_size == tok.tgt_vocab_size
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.pieces([0, 1, 2, 3], "en") == list(dp.SPECIALS)
    for split in ("train", "val", "test"):
        for en, de in zip(fixture_lines(split, "en"), fixture_lines(split, "de"), strict=True):
            src, tgt = tok.encode_src(en), tok.encode_tgt(de)
            assert src[-1] == dp.EOS_ID and dp.EOS_ID not in src[:-1] and dp.BOS_ID not in src
            assert dp.EOS_ID not in tgt and dp.BOS_ID not in tgt
            assert tok.decode_tgt([dp.BOS_ID, *tgt, dp.EOS_ID, 57, 58]) == de  # stops at eos, drops specials
            assert tok.decode_tgt(tok.encode_tgt(en)) == en  # joint model: the source language decodes too
    # digits and "é" never occur in the training text: byte fallback spells them instead of <unk>
    pieces = tok.src_pieces("A zebra eats 12 apples at the café.")
    assert pieces[-1] == "<eos>" and "<unk>" not in pieces and any(p.startswith("<0x") for p in pieces)


def test_spacy_vocabularies_min_freq_and_detokenization(fixture_prepared):
    folder = fixture_prepared["spacy"]
    tok = dp.load_tokenizer(folder)
    assert not tok.joint and tok.src_vocab_size != tok.tgt_vocab_size
    for lang in ("en", "de"):
        vocab = json.loads((folder / f"vocab.{lang}.json").read_text("utf-8"))
        assert vocab[:4] == list(dp.SPECIALS) and len(vocab) == len(set(vocab)) == tok.vocab_size(lang)
    # min_freq=2: "Mann" occurs often in the training text, "Klavier" once
    assert tok.encode_tgt("Mann Klavier") == [tok.index["de"]["Mann"], dp.UNK_ID]
    assert tok.src_pieces("A dog.") == ["A", "dog", ".", "<eos>"]
    assert tok.decode_tgt(tok.encode_tgt("Ein Mann spielt im Park.")) == "Ein Mann spielt im Park."
    text = "Ein Hund rennt am Strand."
    assert tok.decode_tgt(tok.encode_tgt(text) + [dp.EOS_ID, 9]) == text


def test_spacy_lowercase_option(tmp_path):
    tok = dp.load_tokenizer(dp.prepare(fixture_config(tmp_path, tokenizer="spacy", lowercase=True)))
    assert all(w == w.lower() for w in tok.vocab["de"])
    assert tok.encode_tgt("EIN MANN") == tok.encode_tgt("ein mann") != [dp.UNK_ID, dp.UNK_ID]


def test_bpe_lowercase_option(tmp_path):
    """data.lowercase with BPE: vocabulary learnt on lowercased text, any input lowercased before encoding, so
    outputs are lowercase; the raw reference texts kept for scoring stay as they were."""
    folder = dp.prepare(fixture_config(tmp_path, lowercase=True))
    tok = dp.load_tokenizer(folder)
    pieces = [tok.sp.id_to_piece(i) for i in range(len(dp.SPECIALS), tok.sp.get_piece_size())]
    assert not any(p.lower() != p for p in pieces if not p.startswith("<0x"))  # byte pieces spell hex digits
    assert tok.encode_src("A MAN in a Park.") == tok.encode_src("a man in a park.")
    assert tok.decode_tgt(tok.encode_tgt("Ein Mann")) == "ein mann"
    assert dp.read_raw(folder, "val", "de") == fixture_lines("val", "de")
    assert json.loads((folder / "tokenizer.json").read_text("utf-8"))["lowercase"] is True


def test_meta_memory_mapped_splits_and_raw_text(fixture_prepared):
    folder = fixture_prepared["bpe"]
    meta = read_meta(folder)
    assert {name: s["pairs"] for name, s in meta["splits"].items()} == {"train": 40, "val": 12, "test": 10}
    assert meta["valid_split"] == "val" and meta["test_splits"] == ["test"] and meta["dtype"] == "uint16"
    expected_sum = hashlib.sha256((FIXTURES / "val.de").read_bytes()).hexdigest()
    assert meta["inputs"]["val.de"]["sha256"] == expected_sum
    assert meta["src_vocab_size"] == meta["tgt_vocab_size"] == dp.load_tokenizer(folder).src_vocab_size
    tok = dp.load_tokenizer(folder)
    split = dp.load_split(folder, "val")
    assert len(split) == 12 and isinstance(split.src_tokens, np.memmap)
    assert split.src_tokens.dtype == split.tgt_tokens.dtype == np.uint16
    for i, (en, de) in enumerate(zip(fixture_lines("val", "en"), fixture_lines("val", "de"), strict=True)):
        src, tgt = split.pair(i)
        assert src.tolist() == tok.encode_src(en) and tgt.tolist() == tok.encode_tgt(de)
        assert (split.src_lengths[i], split.tgt_lengths[i]) == (len(src), len(tgt))
    assert dp.read_raw(folder, "test", "de") == fixture_lines("test", "de")
    with pytest.raises(UserError, match="no split 'nope'"):
        dp.load_split(folder, "nope")
    with pytest.raises(UserError, match="valid and test"):
        dp.read_raw(folder, "train", "en")


@pytest.mark.parametrize("kind", ["bpe", "spacy"])
def test_tokenizer_save_then_load_from_run_folder(fixture_prepared, tmp_path, kind):
    tok = dp.load_tokenizer(fixture_prepared[kind])
    tok.save(tmp_path / "run" / "tokenizer")
    again = dp.load_tokenizer(tmp_path / "run" / "tokenizer")
    text = fixture_lines("test", "en")[3]
    assert type(again) is type(tok) and again.encode_src(text) == tok.encode_src(text)
    assert (again.src_vocab_size, again.tgt_vocab_size) == (tok.src_vocab_size, tok.tgt_vocab_size)
    with pytest.raises(UserError, match="tokenizer.json"):
        dp.load_tokenizer(tmp_path)


def test_cache_reuse_force_and_cache_key(tmp_path, capsys):
    cfg = fixture_config(tmp_path, tokenizer="spacy")
    folder = dp.prepare(cfg)
    stamp = (folder / "meta.json").stat().st_mtime_ns
    assert dp.prepare(cfg) == folder and (folder / "meta.json").stat().st_mtime_ns == stamp
    assert "using prepared data" in capsys.readouterr().out
    (folder / "marker").touch()
    assert dp.prepare(cfg, force=True) == folder and not (folder / "marker").exists()
    cfg.vocab_size = 1234  # a bpe-only setting: the spacy result is the same
    assert dp.prepare(cfg) == folder
    cfg.min_freq = 1
    assert dp.prepare(cfg) != folder
    cfg.min_freq = 2
    en, de = fixture_lines("train", "en"), fixture_lines("train", "de")
    cfg.train_prefix = write_corpus(tmp_path / "edited", "train", en[:-1] + ["Hello."], de[:-1] + ["Hallo."])
    assert dp.prepare(cfg) != folder  # same settings, other input content
    assert len(list(tmp_path.iterdir())) == 4 and not list(tmp_path.glob("*.tmp*"))
    bpe = fixture_config(tmp_path / "bpe")
    folder = dp.prepare(bpe)
    bpe.min_freq = 1  # a spacy-only setting: the bpe result is the same
    assert dp.prepare(bpe) == folder
    bpe.lowercase = True  # other text, so other data (and the old folders kept their key: the option is new)
    assert dp.prepare(bpe) != folder and dp.prepare(bpe).name.startswith("files_en-de_bpe400-lc_")


def test_train_filters_blank_lines_and_keeps_valid_intact(tmp_path, capsys):
    en = fixture_lines("train", "en") + ["", "A dog.", "word " * 30, "   ", "Yes."]
    de = fixture_lines("train", "de") + ["Ein Hund.", "", "Wort " * 30, "Hallo", "Ja, das ist wirklich so."]
    train = write_corpus(tmp_path / "c", "train", en, de)
    val_en, val_de = fixture_lines("val", "en") + [""], fixture_lines("val", "de") + [""]
    val = write_corpus(tmp_path / "c", "val", val_en, val_de)
    cfg = fixture_config(tmp_path / "p", tokenizer="spacy", train_prefix=train, valid_prefix=val, max_len=20)
    folder = dp.prepare(cfg)
    stats = read_meta(folder)["splits"]
    assert (stats["train"]["lines"], stats["train"]["blank"], stats["train"]["too_long"]) == (45, 3, 1)
    assert stats["train"]["bad_ratio"] == 1  # "Yes." (2 tokens) against 7 tokens
    assert stats["train"]["pairs"] == len(dp.load_split(folder, "train")) == 40
    assert stats["val"]["pairs"] == 13 and dp.read_raw(folder, "val", "de")[-1] == ""
    summary = capsys.readouterr().out
    assert "skipped 3 blank, dropped 1 longer than 20 tokens and 1 with length ratio > 3.0" in summary


def test_bidirectional_train_holds_each_kept_pair_reversed_too(tmp_path, capsys):
    en = fixture_lines("train", "en") + ["", "word " * 100, "Yes."]
    de = fixture_lines("train", "de") + ["Ein Hund.", "Wort " * 100, "Ja, das ist wirklich so."]
    train = write_corpus(tmp_path / "c", "train", en, de)
    one = fixture_config(tmp_path / "p", train_prefix=train, max_len=80)
    both = fixture_config(tmp_path / "p", train_prefix=train, max_len=80, bidirectional=True)
    folder, folder2 = dp.prepare(one), dp.prepare(both)
    assert folder2 != folder and read_meta(folder2)["bidirectional"] and not read_meta(folder)["bidirectional"]
    assert "train holds each kept pair twice, en->de and de->en" in capsys.readouterr().out
    stats, stats2 = read_meta(folder)["splits"], read_meta(folder2)["splits"]
    assert (stats2["train"]["blank"], stats2["train"]["too_long"], stats2["train"]["bad_ratio"]) == (1, 1, 1)
    assert {k: v for k, v in stats2["train"].items() if "tokens" not in k and k != "pairs"} == \
        {k: v for k, v in stats["train"].items() if "tokens" not in k and k != "pairs"}
    forward, doubled = dp.load_split(folder, "train"), dp.load_split(folder2, "train")
    n = len(forward)
    assert n == 40 and len(doubled) == stats2["train"]["pairs"] == 2 * n
    for i in range(n):
        src, tgt = forward.pair(i)
        assert [a.tolist() for a in doubled.pair(i)] == [src.tolist(), tgt.tolist()]
        back_src, back_tgt = doubled.pair(n + i)
        assert back_src.tolist() == tgt.tolist() + [dp.EOS_ID] and back_tgt.tolist() == src[:-1].tolist()
    for split in ("val", "test"):  # evaluated in the configured direction only
        assert [a.tolist() for a in dp.load_split(folder2, split).pair(3)] == \
            [a.tolist() for a in dp.load_split(folder, split).pair(3)]
    assert (folder2 / "spm.model").read_bytes() == (folder / "spm.model").read_bytes()


def test_mismatched_line_counts_name_both_files(tmp_path):
    val = write_corpus(tmp_path, "val", fixture_lines("val", "en"), fixture_lines("val", "de")[:-2])
    with pytest.raises(UserError) as error:
        dp.prepare(fixture_config(tmp_path / "p", valid_prefix=val))
    assert f"{val}.en has 12 lines" in str(error.value) and f"{val}.de has 10" in str(error.value)


def test_non_utf8_input_names_file_and_line(tmp_path):
    train = write_corpus(tmp_path, "train", fixture_lines("train", "en"), fixture_lines("train", "de"))
    lines = (tmp_path / "train.de").read_bytes().split(b"\n")
    lines[6] = "Caf\xe9 au lait".encode("latin-1")
    (tmp_path / "train.de").write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match=r"train\.de: line 7 is not valid UTF-8"):
        dp.prepare(fixture_config(tmp_path / "p", train_prefix=train))


def test_multi30k_layout_gz_or_plain_and_split_errors(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, name in (("train", "train"), ("val", "val"), ("test", "test_2016_flickr")):
        (raw / f"{name}.en.gz").write_bytes(gzip.compress((FIXTURES / f"{split}.en").read_bytes()))
        (raw / f"{name}.de").write_bytes((FIXTURES / f"{split}.de").read_bytes())
    cfg = DataConfig(raw_dir=str(raw), prepared_dir=str(tmp_path / "p"), vocab_size=400,
                     test_splits=["test_2016_flickr"])
    folder = dp.prepare(cfg)
    assert folder.name.startswith("multi30k_en-de_bpe400_")
    assert dp.read_raw(folder, "test_2016_flickr", "en") == fixture_lines("test", "en")
    monkeypatch.setenv("NMT_DOWNLOAD_URL_BASE", (tmp_path / "no-mirror").as_uri())  # never reached below
    for changes, message in [({"src_lang": "cs", "test_splits": ["test_2017_mscoco"]}, "has no 'cs' side"),
                             ({"src_lang": "ja"}, "no language 'ja'"),
                             ({"test_splits": ["test_2018"]}, "no split 'test_2018'"),
                             ({"dataset": "wmt14"}, "WMT14 has no split 'val'")]:
        with pytest.raises(UserError, match=message):
            dp.prepare(DataConfig(**{**vars(cfg), **changes}))


def test_collate_pads_both_sides_to_multiple_of_8(fixture_prepared):
    split = dp.load_split(fixture_prepared["bpe"], "train")
    idx = [0, 5, 9]
    src, tgt_in, tgt_out = dp.collate(split, idx)
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long
    assert src.shape[0] == 3 and tgt_in.shape == tgt_out.shape
    assert src.shape[1] % 8 == tgt_in.shape[1] % 8 == 0  # and no more padding than that:
    assert src.shape[1] - 8 < split.src_lengths[idx].max()
    assert tgt_in.shape[1] - 8 <= split.tgt_lengths[idx].max()
    for row, i in enumerate(idx):
        s, t = (a.tolist() for a in split.pair(i))
        assert src[row].tolist() == s + [0] * (src.shape[1] - len(s))
        assert tgt_in[row].tolist() == [dp.BOS_ID, *t] + [0] * (tgt_in.shape[1] - len(t) - 1)
        assert tgt_out[row].tolist() == [*t, dp.EOS_ID] + [0] * (tgt_out.shape[1] - len(t) - 1)
    assert dp.collate(split, [1], pad_multiple=1)[0].shape == (1, split.src_lengths[1])


# ------------------------------------------------------------------------------------------- batching


def test_bpe_merges_without_dropout_equal_sentencepiece(fixture_prepared):
    """The numpy BPE that BPE-dropout runs gives SentencePiece's own ids at dropout 0, on every fixture line and
    on text with runs of spaces, a leading space and characters outside the vocabulary (byte pieces)."""
    tok = dp.load_tokenizer(fixture_prepared["bpe"])
    lines = [line for split in ("train", "val", "test") for lang in ("en", "de") for line in fixture_lines(split, lang)]
    lines += [" a  dog", "Grüße aus Köln!", "日本 ok", "", "x"]
    bpe = dp.BpeMerges(tok.sp)
    tokens, offsets = bpe.encode(*bpe.chars(lines), len(lines))
    assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == tok.encode_lines(
        lines, "en")


def test_bpe_dropout_recuts_the_same_text_each_epoch(fixture_prepared):
    """Each epoch's pairs spell the training text exactly, in other (more, smaller) pieces than prepared; the same
    epoch gives the same pieces again (exact resume, every rank alike), another epoch others; every target piece
    is in the tokenizer's reachable set (model.output_vocab: target keeps them emittable)."""
    tok = dp.load_tokenizer(fixture_prepared["bpe"])
    train = dp.load_split(fixture_prepared["bpe"], "train")
    src_text, tgt_text = train.texts(tok)
    assert src_text == fixture_lines("train", "en") and tgt_text == fixture_lines("train", "de")
    recut = dp.BpeDropout(train, tok, dropout=0.1, seed=1)
    first, again, second = recut(0), recut(0), recut(1)
    assert len(first) == len(train) and first.src_lengths.sum() > train.src_lengths.sum()
    for i in range(len(train)):
        src, tgt = first.pair(i)
        assert src[-1] == dp.EOS_ID and tok.decode(src[:-1].tolist(), "en") == src_text[i]
        assert tok.decode(tgt.tolist(), "de") == tgt_text[i]
    assert np.array_equal(first.tgt_tokens, again.tgt_tokens) and np.array_equal(first.src_offsets, again.src_offsets)
    assert not np.array_equal(first.tgt_offsets, second.tgt_offsets)
    reachable = set(recut.bpe.reachable(tgt_text).tolist())
    sampled = set(np.concatenate([recut(e).tgt_tokens for e in range(5)]).tolist())
    assert sampled <= reachable and set(np.asarray(train.tgt_tokens).tolist()) <= reachable


def test_batch_stream_batches_each_epochs_own_cut(fixture_prepared):
    """With resegment, each epoch's batches hold that epoch's pairs, every pair once, within max_tokens; resuming
    at (epoch, batch) gives the same batches as running through."""
    tok = dp.load_tokenizer(fixture_prepared["bpe"])
    train = dp.load_split(fixture_prepared["bpe"], "train")
    recut = dp.BpeDropout(train, tok, dropout=0.2, seed=3)

    def stream() -> dp.BatchStream:
        sampler = dp.TokenBatchSampler(train.src_lengths, train.tgt_lengths, 96, seed=3, pad_multiple=1)
        return dp.BatchStream(train, sampler, 0, 1, max_epochs=2, resegment=recut)

    full = list(stream())
    for epoch in range(2):
        cut, seen = recut(epoch), []
        sampler = dp.TokenBatchSampler(cut.src_lengths, cut.tgt_lengths, 96, seed=3, pad_multiple=1)
        sampler.set_epoch(epoch)
        for indices in sampler:
            seen += indices
            assert max(max(len(cut.pair(i)[0]), len(cut.pair(i)[1]) + 1) for i in indices) * len(indices) <= 96
        assert sorted(seen) == list(range(len(train)))
    n0 = sum(1 for _ in dp.TokenBatchSampler(recut(0).src_lengths, recut(0).tgt_lengths, 96, seed=3, pad_multiple=1))
    resumed = stream()
    resumed.epoch, resumed.batch_in_epoch = 1, 2
    for a, b in zip(full[n0 + 2 :], list(resumed), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert sum(int(b[2].ne(0).sum()) for b in full[:n0]) == recut(0).tgt_lengths.sum() + len(train)  # + eos


def test_source_token_drop_blanks_pieces_only_and_resumes_the_same(fixture_prepared):
    """Token Drop turns about p of the source pieces into <unk> (never eos or padding, never a target), the rest
    stay, and a resumed stream draws the same as one run straight through."""
    train = dp.load_split(fixture_prepared["bpe"], "train")

    def stream(p: float) -> dp.BatchStream:
        sampler = dp.TokenBatchSampler(train.src_lengths, train.tgt_lengths, 96, seed=3, pad_multiple=1)
        return dp.BatchStream(train, sampler, dp.PAD_ID, 1, max_epochs=2, src_token_drop=p)

    clean, dropped = list(stream(0.0)), list(stream(0.3))
    blanked = kept = 0
    for (src, tgt_in, tgt_out), (dsrc, dtgt_in, dtgt_out) in zip(clean, dropped, strict=True):
        assert torch.equal(tgt_in, dtgt_in) and torch.equal(tgt_out, dtgt_out)
        pieces = src.ne(dp.PAD_ID) & src.ne(dp.EOS_ID)
        assert torch.equal(src[~pieces], dsrc[~pieces])  # eos and padding untouched
        changed = dsrc.ne(src)
        assert bool((dsrc[changed] == dp.UNK_ID).all()) and not bool((changed & ~pieces).any())
        blanked, kept = blanked + int(changed.sum()), kept + int((pieces & ~changed).sum())
    assert 0.25 < blanked / (blanked + kept) < 0.35, blanked / (blanked + kept)
    resumed = stream(0.3)
    n0 = len(resumed.sampler)
    resumed.epoch, resumed.batch_in_epoch = 1, 2
    for a, b in zip(dropped[n0 + 2 :], list(resumed), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def random_lengths(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 60, n), rng.integers(1, 60, n)


def padded_tokens(src, tgt, batch) -> int:
    """What collate allocates for the batch on its larger side."""
    up = lambda n: -(-int(n) // 8) * 8  # noqa: E731
    return len(batch) * max(up(src[batch].max()), up(tgt[batch].max() + 1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sampler_max_tokens_and_each_pair_once_across_ranks(world_size):
    src, tgt = random_lengths(5003)
    seen, counts, padded = [], [], 0
    for rank in range(world_size):
        sampler = dp.TokenBatchSampler(src, tgt, 1000, shuffle=True, seed=3, rank=rank, world_size=world_size)
        sampler.set_epoch(2)
        batches = list(sampler)
        counts.append(len(batches))
        assert len(batches) == len(sampler) and all(padded_tokens(src, tgt, b) <= 1000 for b in batches)
        seen += [i for b in batches for i in b]
        padded += sum(padded_tokens(src, tgt, b) for b in batches)
    assert len(set(counts)) == 1 and sorted(seen) == list(range(5003))
    own = sum(padded_tokens(src, tgt, [i]) for i in range(5003))
    assert padded < 1.05 * own  # bucketing: almost no padding beyond each pair's own rounding


def test_sampler_batches_fit_when_collated(fixture_prepared):
    split = dp.load_split(fixture_prepared["spacy"], "train")
    sampler = dp.TokenBatchSampler(split.src_lengths, split.tgt_lengths, max_tokens=96, seed=1)
    for batch in sampler:
        src, tgt_in, _ = dp.collate(split, batch)
        assert src.numel() <= 96 and tgt_in.numel() <= 96


def test_sampler_deterministic_per_seed_reshuffled_per_epoch():
    src, tgt = random_lengths(2000)
    make = lambda seed, shuffle=True: dp.TokenBatchSampler(src, tgt, 800, shuffle=shuffle, seed=seed)  # noqa: E731
    a, b = make(1), make(1)
    first = list(a)
    assert first == list(b) == list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(map(sorted, a)) != sorted(map(sorted, first))  # new order, new batches
    assert list(make(2)) != first
    fixed = make(5, shuffle=False)
    fixed.set_epoch(7)
    assert list(fixed) == list(make(9, shuffle=False))
    costs = [padded_tokens(src, tgt, b) / len(b) for b in fixed]
    assert costs == sorted(costs)


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_sampler_resume_from_batch_k(rank, world_size):
    src, tgt = random_lengths(3000, seed=4)
    sampler = dp.TokenBatchSampler(src, tgt, 700, seed=8, rank=rank, world_size=world_size)
    sampler.set_epoch(4)
    full = list(sampler)
    assert list(sampler.iter_from(5)) == full[5:] and list(sampler.iter_from(len(full))) == []


def test_sampler_oversized_pair_gets_own_batch_and_too_few_pairs_for_ranks():
    batches = list(dp.TokenBatchSampler([5, 300, 6, 7], [5, 5, 300, 6], 64, shuffle=False))
    assert [1] in batches and [2] in batches and sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    with pytest.raises(UserError, match="3 ranks"):
        dp.TokenBatchSampler([3, 4], [3, 4], 100, world_size=3)


# ------------------------------------------------------------------------------------------ downloads


class FakeResponse(io.BytesIO):
    headers = {"Content-Length": "4"}


def test_download_checks_sha256_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora, "RETRY_DELAYS", (0.0, 0.0))
    source = tmp_path / "mirror" / "val.en.gz"
    source.parent.mkdir()
    source.write_bytes(gzip.compress(b"A dog.\n"))
    dest = tmp_path / "raw" / "val.en.gz"
    corpora.download(source.as_uri(), dest, hashlib.sha256(source.read_bytes()).hexdigest())
    assert dest.read_bytes() == source.read_bytes()
    with pytest.raises(ValueError, match="sha256 mismatch"):
        corpora.download(source.as_uri(), tmp_path / "raw" / "other.gz", "0" * 64)
    assert list((tmp_path / "raw").iterdir()) == [dest]


@pytest.mark.parametrize("failure", ["offline", "truncated"])
def test_multi30k_download_failure_is_one_clear_error(tmp_path, monkeypatch, failure):
    calls = []

    def urlopen(url, timeout):
        calls.append(url)
        if failure == "offline":
            raise urllib.error.URLError(OSError("Temporary failure in name resolution"))
        return FakeResponse(b"\x1f\x8b")  # the first bytes of a gzip file, then the connection drops

    monkeypatch.setattr(corpora.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(corpora, "RETRY_DELAYS", (0.0, 0.0))
    monkeypatch.delenv("NMT_DOWNLOAD_URL_BASE", raising=False)
    monkeypatch.delenv("MULTI30K_DIR", raising=False)  # no local copy to fall back on
    with pytest.raises(UserError) as error:
        dp.prepare(DataConfig(raw_dir=str(tmp_path / "raw"), prepared_dir=str(tmp_path / "p")))
    message = str(error.value)
    assert f"{corpora.MULTI30K_URL}/train.en.gz" in message and "train.en.gz is not in data.raw_dir=" in message
    assert "\n" not in message and ("sha256" in message) == (failure == "truncated")
    assert len(calls) == 3 and list((tmp_path / "raw").iterdir()) == []  # retried; nothing partial kept


@pytest.mark.realdata
def test_multi30k_pinned_checksums_and_mirror_download(multi30k, tmp_path, monkeypatch):
    checked = [name for name in corpora.MULTI30K_SHA256 if (multi30k / name).is_file()]
    assert checked, f"no Multi30k .gz files in {multi30k}"
    for name in checked:
        assert hashlib.sha256((multi30k / name).read_bytes()).hexdigest() == corpora.MULTI30K_SHA256[name], name
    monkeypatch.setenv("NMT_DOWNLOAD_URL_BASE", multi30k.as_uri())
    monkeypatch.delenv("MULTI30K_DIR", raising=False)  # make it download from the mirror
    path = corpora.multi30k_files(DataConfig(raw_dir=str(tmp_path), test_splits=[]))["val"]["de"]
    assert path == tmp_path / "val.de.gz" and path.read_bytes() == (multi30k / "val.de.gz").read_bytes()


# ---------------------------------------------------------------------------------- Multi30k (real data)


@pytest.mark.realdata
def test_multi30k_bpe_split_sizes_round_trip_and_batches(multi30k_prepared):
    folder = multi30k_prepared["bpe"]
    meta = read_meta(folder)
    assert {name: s["lines"] for name, s in meta["splits"].items()} == MULTI30K_SIZES
    assert all(meta["splits"][name]["pairs"] == n for name, n in MULTI30K_SIZES.items() if name != "train")
    assert meta["splits"]["train"]["pairs"] > 28_900  # the length filters drop a handful of odd pairs only
    tok = dp.load_tokenizer(folder)
    assert tok.src_vocab_size == tok.tgt_vocab_size == 8000
    for split in MULTI30K_SIZES.keys() - {"train"}:
        for lang in ("en", "de"):
            lines = dp.read_raw(folder, split, lang)
            for line, ids in zip(lines, tok.encode_lines(lines, lang), strict=True):
                assert tok.decode_tgt(ids) == line  # exact, including double spaces and unseen characters
    train = dp.load_split(folder, "train")
    for world_size in (1, 2, 3):
        ranks = [dp.TokenBatchSampler(train.src_lengths, train.tgt_lengths, 4096, seed=1, rank=r,
                                      world_size=world_size) for r in range(world_size)]
        batches = [b for sampler in ranks for b in sampler]
        assert len({len(sampler) for sampler in ranks}) == 1
        assert sorted(i for b in batches for i in b) == list(range(len(train)))
        assert max(padded_tokens(train.src_lengths, train.tgt_lengths, b) for b in batches) <= 4096
    print("bpe <unk> rates:", {k: (round(s["src_unk_rate"], 4), round(s["tgt_unk_rate"], 4))
                               for k, s in meta["splits"].items()})


@pytest.mark.realdata
def test_multi30k_spacy_tokens_vocab_and_unk_rates(multi30k_prepared):
    folder = multi30k_prepared["spacy"]
    tok, meta = dp.load_tokenizer(folder), read_meta(folder)
    assert tok.src_pieces("A man rides a bike.") == ["A", "man", "rides", "a", "bike", ".", "<eos>"]
    german = tok.pieces(tok.encode_tgt("Ein Mann fährt Fahrrad."), "de")
    assert german == ["Ein", "Mann", "fährt", "Fahrrad", "."]
    assert tok.pieces(tok.encode_tgt("Zwei Hunde spielen im Schnee, nicht?"), "de") == [
        "Zwei", "Hunde", "spielen", "im", "Schnee", ",", "nicht", "?"]
    assert 4000 < tok.src_vocab_size < 10000 and 4000 < tok.tgt_vocab_size < 12000
    val = meta["splits"]["val"]
    assert val["src_unk_rate"] < 0.05 and val["tgt_unk_rate"] < 0.08
    lines = dp.read_raw(folder, "val", "de")
    encoded = tok.encode_lines(lines, "de")
    known = [(line, ids) for line, ids in zip(lines, encoded, strict=True) if dp.UNK_ID not in ids]
    exact = sum(tok.decode_tgt(ids) == line for line, ids in known)
    assert exact > 0.9 * len(known)  # Moses detokenization restores nearly every sentence exactly
    print("spacy <unk> rates:", {k: (round(s["src_unk_rate"], 4), round(s["tgt_unk_rate"], 4))
                                 for k, s in meta["splits"].items()})


# ----------------------------------------------------------------------------------------------- CLI


def assert_one_line_error(result, *needles):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """One good and several bad command lines, started at once (each process spends seconds on imports)."""
    tmp = tmp_path_factory.mktemp("cli_runs")
    val = write_corpus(tmp, "val", fixture_lines("val", "en")[:-1], fixture_lines("val", "de"))
    good = write_config(tmp / "good.yaml", fixture_data(tmp / "p"))
    missing = write_config(tmp / "m.yaml", {"raw_dir": str(tmp / "missing"), "prepared_dir": str(tmp / "p")})
    mirror = (tmp / "offline-mirror").as_uri()  # NMT_DOWNLOAD_URL_BASE: fails at once, like no network
    cases = {"ok": (good, ["--force", "data.max_len=100", "train.max_tokens=40", "train.pad_multiple=1"], {}),
             "missing": (missing, [], {"NMT_DOWNLOAD_URL_BASE": mirror, "MULTI30K_DIR": ""}),
             "mismatch": (write_config(tmp / "bad.yaml", fixture_data(tmp / "p", valid_prefix=val)), [], {}),
             "dataset": (good, ["data.dataset=wmt99"], {}),
             "tokenizer": (good, ["data.tokenizer=wordpiece"], {}),
             "key": (good, ["data.vocab_sise=100"], {})}
    started = {name: start_script("data_preparation.py", "--config", str(config), *args, cwd=tmp, env=env)
               for name, (config, args, env) in cases.items()}
    results = {name: finish(process) for name, process in started.items()}
    return {**results, "tmp": tmp, "mirror": mirror, "val": val}


def test_cli_prepares_with_overrides_and_force(cli_runs):
    ok = cli_runs["ok"]
    assert ok.returncode == 0, ok.stderr
    assert "prepared files en-de (bpe, joint vocabulary" in ok.stdout and "batches per epoch" in ok.stdout
    assert "train: 40 lines" in ok.stdout and "longer than 100 tokens" in ok.stdout


def test_cli_counts_the_batches_the_trainer_makes(cli_runs):
    """The count printed is the trainer's: its max_tokens with its pad_multiple (not the sampler's default of 8)."""
    from data_preparation import TokenBatchSampler, load_split

    train = load_split(next((cli_runs["tmp"] / "p").iterdir()), "train")
    count = {m: len(TokenBatchSampler(train.src_lengths, train.tgt_lengths, 40, pad_multiple=m)) for m in (1, 8)}
    assert count[1] != count[8]  # the fixture tells the two apart
    assert f"train: {count[1]} batches per epoch at train.max_tokens=40, train.pad_multiple=1" in cli_runs["ok"].stdout


def test_cli_missing_multi30k_without_network(cli_runs):
    raw_dir = f"data.raw_dir={cli_runs['tmp'] / 'missing'}"
    url = f"{cli_runs['mirror']}/train.en.gz"
    assert_one_line_error(cli_runs["missing"], "train.en.gz", url, raw_dir)


def test_cli_mismatched_line_counts(cli_runs):
    val = cli_runs["val"]
    assert_one_line_error(cli_runs["mismatch"], f"{val}.en has 11 lines", f"{val}.de has 12")


@pytest.mark.parametrize("case, needle", [("dataset", "wmt99"), ("tokenizer", "wordpiece"),
                                           ("key", "data.vocab_sise")])
def test_cli_bad_config_values(cli_runs, case, needle):
    assert_one_line_error(cli_runs[case], needle)
