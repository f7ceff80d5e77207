"""WMT14 En-De (issue 8): the data pipeline on a synthetic fixture in the real file formats, the download of an
archive, parallel encoding, and the paper's base/big recipes. The corpus itself cannot be fetched here."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile

import numpy as np
import pytest
import torch
from conftest import ROOT

import corpora
import data_preparation as dp
import scoring
from config import DataConfig, load_config
from runtime import UserError
from transformer_model import Transformer, count_parameters

_spec = importlib.util.spec_from_file_location("make_wmt14_fixture", ROOT / "scripts" / "make_wmt14_fixture.py")
fixture_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture_script)

COUNTS = {"europarl-v7.de-en": 1200, "commoncrawl.de-en": 1500, "news-commentary-v9.de-en": 300,
          "newstest2013": 200, "newstest2014": 300}


def wmt14_config(raw_dir, prepared_dir, **changes) -> DataConfig:
    data = {"dataset": "wmt14", "src_lang": "en", "tgt_lang": "de", "raw_dir": str(raw_dir),
            "prepared_dir": str(prepared_dir), "tokenizer": "bpe", "vocab_size": 500, "max_len": 60,
            "valid_split": "newstest2013", "test_splits": ["newstest2014"], "sample_size": 2000, "num_workers": 1}
    return DataConfig(**{**data, **changes})


@pytest.fixture(scope="module")
def wmt14_raw(tmp_path_factory):
    raw = tmp_path_factory.mktemp("wmt14_raw")
    assert fixture_script.make_fixture(raw, 3000) == COUNTS
    return raw


@pytest.fixture(scope="module")
def wmt14_prepared(wmt14_raw, tmp_path_factory):
    return dp.prepare(wmt14_config(wmt14_raw, tmp_path_factory.mktemp("wmt14_prepared")))


def test_sgm_parsing_matches_sacrebleu_and_counts(tmp_path):
    sgm = tmp_path / "newstest2014-deen-ref.de.sgm"
    fixture_script.write_sgm(sgm, ["Ein  Haus .", "  Zwei\tHäuser &amp; mehr ", ""], "de", "ref")
    assert corpora.read_lines(sgm) == ["Ein Haus .", "Zwei Häuser &amp; mehr", ""]
    assert corpora.count_lines(sgm) == 3 and corpora.wmt14_corpus(sgm) == "newstest2014"
    assert corpora.wmt14_corpus(tmp_path / "newstest2013.en") == "newstest2013"
    plain = tmp_path / "x.en"
    plain.write_bytes(b"a\r\nb\n\nc")  # no final newline, a CR: both as read_lines sees them
    assert corpora.count_lines(plain) == len(corpora.read_lines(plain)) == 4 and corpora.read_lines(plain)[0] == "a"


def test_wmt14_fixture_prepared_end_to_end(wmt14_raw, wmt14_prepared):
    meta = dp.load_meta(wmt14_prepared)
    splits = meta["splits"]
    train_lines = sum(COUNTS[c] for c in corpora.WMT14_TRAIN)
    assert splits["train"]["lines"] == train_lines and splits["train"]["blank"] == 1
    assert splits["train"]["too_long"] == 1  # the 300-word commoncrawl line
    assert splits["train"]["pairs"] == train_lines - 2 - splits["train"]["bad_ratio"]
    assert (splits["newstest2013"]["pairs"], splits["newstest2014"]["pairs"]) == (200, 300)
    assert meta["valid_split"] == "newstest2013" and meta["test_splits"] == ["newstest2014"]
    inputs = meta["inputs"]
    assert inputs["train.en.europarl-v7.de-en.en"]["path"].endswith("training/europarl-v7.de-en.en")
    assert inputs["newstest2014.de"]["path"].endswith("test-full/newstest2014-deen-ref.de.sgm")
    tok = dp.load_tokenizer(wmt14_prepared)
    refs = dp.read_raw(wmt14_prepared, "newstest2014", "de")
    assert refs == corpora.read_lines(wmt14_raw / "test-full/newstest2014-deen-ref.de.sgm") and len(refs) == 300
    sources = dp.read_raw(wmt14_prepared, "newstest2014", "en")
    assert sources[0] == 'The &quot;big&quot; house'  # whitespace collapsed as sacreBLEU does
    test = dp.load_split(wmt14_prepared, "newstest2014")
    for i in (0, 1, 150, 299):
        src, tgt = test.pair(i)
        assert src.tolist() == tok.encode_src(sources[i]) and src[-1] == dp.EOS_ID
        assert tok.decode_tgt(tgt) == refs[i]  # exact round trip
    train = dp.load_split(wmt14_prepared, "train")
    europarl = corpora.read_lines(wmt14_raw / "training/europarl-v7.de-en.de")
    assert tok.decode_tgt(train.pair(0)[1]) == europarl[0]  # corpora in order, starting with Europarl
    assert len(train) == splits["train"]["pairs"] and int(train.tgt_lengths.sum()) == splits["train"]["tgt_tokens"]


def test_two_encoding_processes_give_the_same_arrays(wmt14_raw, wmt14_prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(dp, "ENCODE_CHUNK", 250)  # 12 chunks: several in flight in each worker
    cfg = wmt14_config(wmt14_raw, tmp_path)
    sides = [corpora.file_list(p) for p in corpora.wmt14_files(cfg)["train"].values()]
    arrays = {}
    for workers in (1, 2):
        folder = tmp_path / f"w{workers}"
        dp.load_tokenizer(wmt14_prepared).save(folder)
        stats = dp._encode_split(cfg, folder, "train", sides, 3000, np.uint16, workers)
        arrays[workers] = [np.load(folder / f"train.{part}.npy") for part in
                           ("src.tokens", "src.offsets", "tgt.tokens", "tgt.offsets")]
        assert stats == dp.load_meta(wmt14_prepared)["splits"]["train"]
        assert not list(folder.glob("*.bin"))
    for one, two in zip(arrays[1], arrays[2], strict=True):
        assert one.dtype == two.dtype and np.array_equal(one, two)
    assert np.array_equal(arrays[1][0], np.load(wmt14_prepared / "train.src.tokens.npy"))


def test_download_extracts_checks_and_rejects_a_bad_checksum(wmt14_raw, tmp_path, monkeypatch):
    """One archive from a file:// mirror: only the known members are extracted, flat (a ../ member cannot
    escape); a checksum mismatch is one clear UserError and leaves nothing behind."""
    archive = tmp_path / "mirror" / "wmt14" / "training-parallel-nc-v9.tgz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        for lang in ("de", "en"):
            name = f"training/news-commentary-v9.de-en.{lang}"
            tar.add(wmt14_raw / name, name)
        evil = b"gotcha\n"
        info = tarfile.TarInfo("../../news-commentary-v9.de-en.de")  # duplicate name, traversal path
        info.size = len(evil)
        tar.addfile(info, io.BytesIO(evil))
    monkeypatch.setenv("NMT_WMT14_URL_BASE", (tmp_path / "mirror").as_uri())
    monkeypatch.setattr(corpora, "RETRY_DELAYS", (0.0, 0.0))
    rel, _, _, members = corpora.WMT14_ARCHIVES["training-parallel-nc-v9.tgz"]
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    raw = tmp_path / "raw"
    monkeypatch.setitem(corpora.WMT14_ARCHIVES, "training-parallel-nc-v9.tgz", (rel, "0" * 64, None, members))
    with pytest.raises(UserError) as error:
        corpora._wmt14_fetch(raw, "training-parallel-nc-v9.tgz")
    assert "sha256 mismatch" in str(error.value) and "wmt14/training-parallel-nc-v9.tgz" in str(error.value)
    assert "\n" not in str(error.value) and list(raw.iterdir()) == []
    monkeypatch.setitem(corpora.WMT14_ARCHIVES, "training-parallel-nc-v9.tgz", (rel, good, None, members))
    monkeypatch.setitem(corpora.WMT14_LINES, "news-commentary-v9.de-en", 300)
    corpora._wmt14_fetch(raw, "training-parallel-nc-v9.tgz")
    assert sorted(p.name for p in raw.iterdir()) == ["news-commentary-v9.de-en.de", "news-commentary-v9.de-en.en"]
    assert (raw / "news-commentary-v9.de-en.de").read_bytes() == (
        wmt14_raw / "training/news-commentary-v9.de-en.de").read_bytes()
    assert not (tmp_path / "news-commentary-v9.de-en.de").exists()
    monkeypatch.setitem(corpora.WMT14_LINES, "news-commentary-v9.de-en", 201_288)  # the real size: not this archive
    with pytest.raises(UserError, match="has 300 lines, expected 201288"):
        corpora._wmt14_fetch(tmp_path / "raw2", "training-parallel-nc-v9.tgz")
    assert list((tmp_path / "raw2").iterdir()) == []


def test_wmt14_config_errors(wmt14_raw, tmp_path):
    for changes, message in [({"src_lang": "fr"}, "English-German"),
                             ({"valid_split": "val"}, "WMT14 has no split 'val'"),
                             ({"test_splits": ["newstest2012"]}, "no known archive has it")]:
        with pytest.raises(UserError, match=message):
            dp.prepare(wmt14_config(wmt14_raw, tmp_path, **changes))


@pytest.mark.parametrize("name, low, high", [("base", 62e6, 66e6), ("big", 210e6, 216e6)])
def test_recipes_load_and_match_table3_sizes(name, low, high):
    cfg = load_config(ROOT / "configs" / f"wmt14_en_de_{name}.yaml")
    assert cfg.data.dataset == "wmt14" and cfg.data.vocab_size == 37000 and cfg.model.share_embeddings
    assert not cfg.model.norm_first and cfg.train.warmup == 4000 and cfg.train.average_last <= cfg.train.keep_last
    assert 24000 <= cfg.train.max_tokens * cfg.train.update_freq <= 26000  # per side and update, on 1 GPU
    assert (cfg.decode.beam, cfg.decode.len_penalty) == (4, 0.6)
    cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = cfg.data.vocab_size
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assert low <= count_parameters(model) <= high


def test_compound_split_bleu_scores_hyphenated_compounds_by_parts():
    spec = importlib.util.spec_from_file_location("wmt14_bleu", ROOT / "scripts" / "wmt14_bleu.py")
    bleu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bleu)
    assert scoring.split_compounds("Die Arbeits-Platz-Suche , 3-4") == \
        "Die Arbeits ##AT##-##AT## Platz ##AT##-##AT## Suche , 3 ##AT##-##AT## 4"
    refs = ["Die Arbeits-Platz-Suche in der Stadt ist schwer, sagte er."]
    hyps = ["Die Arbeits-Stellen-Suche in der Stadt ist schwer, sagte er."]
    split = bleu.compound_split_bleu(hyps, refs)
    unsplit = bleu.sacrebleu.metrics.BLEU(tokenize="none").corpus_score(hyps, [refs]).score
    assert split > unsplit  # a wrong part of a compound costs one token, not the whole word
    score, signature = bleu.sacrebleu_with_signature(hyps, refs)
    assert bleu.compound_split_bleu(refs, refs) == pytest.approx(100.0)
    assert score < 100 and "case:mixed" in signature and "tok:13a" in signature
