"""Nothing lost, nothing mixed up (data and config side): rebuilding the same data gives the same tokenizer, so
runs keep resuming; a damaged prepared folder is one line saying to rerun with --force; a YAML key given twice
is an error, not a silent reset; values that would crash preparation or training later fail at validation.

Failures are checked as the user sees them: main() of a script through cli_main, one `error:` line, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, fixture_config, fixture_data, fixture_lines, write_config, write_corpus

import checkpoint
import data_preparation as dp
from config import load_config
from runtime import UserError, cli_main

TOKENIZER_FILES = ("tokenizer.json", "spm.model", "spm.vocab")


def run_main(main, args, capsys, monkeypatch):
    """main(argv) through cli_main in this process, as the script runs it: (status, stdout, stderr)."""
    monkeypatch.setenv("NMT_DEBUG", "0")
    monkeypatch.setenv("NMT_NO_TCMALLOC", "1")
    capsys.readouterr()
    try:
        cli_main(main, [str(a) for a in args])
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status, err: str, *words: str):
    assert status not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.split("\n") if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], err


def file_bytes(folder: Path) -> dict:
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES}


# ---------------------------------------------------------------- 1. the same data gives the same tokenizer


def test_preparing_the_same_data_again_gives_byte_identical_tokenizer_files(tmp_path):
    first = dp.prepare(fixture_config(tmp_path / "a"))
    second = dp.prepare(fixture_config(tmp_path / "b"))  # another prepared_dir (another machine, a moved folder)
    files = file_bytes(first)
    assert file_bytes(second) == files
    assert checkpoint.tokenizer_fingerprint(second) == checkpoint.tokenizer_fingerprint(first)
    assert str(tmp_path).encode() not in files["spm.model"]  # no build path recorded inside the model
    fingerprint = checkpoint.tokenizer_fingerprint(first)
    assert dp.prepare(fixture_config(tmp_path / "a"), force=True) == first
    assert file_bytes(first) == files and checkpoint.tokenizer_fingerprint(first) == fingerprint
    tok = dp.load_tokenizer(first)  # the edited model still loads and round-trips
    for line in fixture_lines("val", "de"):
        assert tok.decode_tgt(tok.encode_tgt(line)) == line


def test_a_run_resumes_after_its_prepared_data_is_rebuilt(tmp_path):
    """End to end: train, delete the prepared folder, resume (which prepares the data again)."""
    env = {**os.environ, "NMT_DEBUG": "0", "NMT_NO_TCMALLOC": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MULTI30K_DIR", None)
    prepared = tmp_path / "prepared"
    args = [sys.executable, str(ROOT / "train_transformer.py"), "--config", "configs/tiny.yaml",
            f"train.out_dir={tmp_path / 'run'}", f"data.prepared_dir={prepared}", "train.eval_every=10",
            "decode.max_len_a=0", "decode.max_len_b=4"]
    first = subprocess.run([*args, "train.max_steps=10"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(prepared)
    resumed = subprocess.run([*args, "train.max_steps=12", "--resume"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert prepared.is_dir()


# ---------------------------------------------------------------- 2. a damaged prepared folder


@pytest.fixture(scope="module")
def prepared_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared") / "prepared"
    dp.prepare(fixture_config(root))
    return root


def damage(folder: Path, case: str) -> None:
    def cut(name):
        path = folder / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    if case == "meta_truncated":
        cut("meta.json")
    elif case == "meta_not_a_mapping":
        (folder / "meta.json").write_text("[1, 2]\n", encoding="utf-8")
    elif case == "meta_without_splits":
        meta = json.loads((folder / "meta.json").read_text("utf-8"))
        del meta["splits"]
        (folder / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    elif case == "npy_truncated":
        cut("train.src.tokens.npy")
    elif case == "npy_header_only":
        path = folder / "train.tgt.offsets.npy"
        path.write_bytes(path.read_bytes()[:40])
    elif case == "npy_missing":
        (folder / "val.tgt.offsets.npy").unlink()
    elif case == "npy_of_another_split":  # same format, wrong content: offsets no longer match meta.json
        shutil.copy(folder / "test.src.offsets.npy", folder / "train.src.offsets.npy")
    elif case == "raw_text_missing":
        (folder / "val.de.txt").unlink()
    elif case == "tokenizer_kind":
        info = json.loads((folder / "tokenizer.json").read_text("utf-8"))
        (folder / "tokenizer.json").write_text(json.dumps({**info, "kind": "wordpiece"}), encoding="utf-8")
    elif case == "tokenizer_json_truncated":
        cut("tokenizer.json")
    elif case == "spm_missing":
        (folder / "spm.model").unlink()
    elif case == "spm_truncated":
        cut("spm.model")
    else:
        raise AssertionError(case)


DAMAGE = ["meta_truncated", "meta_not_a_mapping", "meta_without_splits", "npy_truncated", "npy_header_only",
          "npy_missing", "npy_of_another_split", "raw_text_missing", "tokenizer_kind", "tokenizer_json_truncated",
          "spm_missing", "spm_truncated"]
CHECKED_BY_LOADERS = {  # what each case breaks for the reader that meets it first in training
    "npy_truncated": lambda f: dp.load_split(f, "train"), "npy_missing": lambda f: dp.load_split(f, "val"),
    "npy_of_another_split": lambda f: dp.load_split(f, "train"), "meta_truncated": dp.load_meta,
    "tokenizer_kind": dp.load_tokenizer, "spm_missing": dp.load_tokenizer, "spm_truncated": dp.load_tokenizer,
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_prepared_folder_is_one_line_and_force_rebuilds_it(case, prepared_root, tmp_path, capsys,
                                                                   monkeypatch):
    root = tmp_path / "prepared"
    shutil.copytree(prepared_root, root)
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    damage(folder, case)
    config = write_config(tmp_path / "data.yaml", fixture_data(root))
    status, out, err = run_main(dp.main, ["--config", config], capsys, monkeypatch)
    assert_one_line_error(status, err, str(folder), "rerun with --force")
    status, out, err = run_main(dp.main, ["--config", config, "--force"], capsys, monkeypatch)
    assert status == 0, err
    dp.check_prepared(folder)
    assert file_bytes(folder) == file_bytes(next(p for p in prepared_root.iterdir() if p.is_dir()))


@pytest.mark.parametrize("case", list(CHECKED_BY_LOADERS))
def test_loaders_report_a_damaged_folder_in_one_line(case, prepared_root, tmp_path):
    """The trainer and translate.py read prepared folders without prepare() too: the readers check as well."""
    (source,) = [p for p in prepared_root.iterdir() if p.is_dir()]
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    damage(folder, case)
    with pytest.raises(UserError, match="rerun with --force") as error:
        CHECKED_BY_LOADERS[case](folder)
    assert str(folder) in str(error.value) and "\n" not in str(error.value)


def test_damaged_run_tokenizer_is_not_told_to_rerun_data_preparation(prepared_root, tmp_path):
    (source,) = [p for p in prepared_root.iterdir() if p.is_dir()]
    run_tokenizer = tmp_path / "run" / "tokenizer"
    dp.load_tokenizer(source).save(run_tokenizer)
    damage(run_tokenizer, "spm_truncated")
    with pytest.raises(UserError, match="copy it from the prepared data folder"):
        dp.load_tokenizer(run_tokenizer)


# ---------------------------------------------------------------- 3. YAML keys given twice


DUPLICATES = [  # (config text, key named, line of the repetition)
    ("train:\n  max_steps: 5\n  warmup: 2\ntrain:\n  max_steps: 7\n", "'train'", "lines 1 and 4"),
    ("train:\n  max_steps: 5\n  warmup: 2\n  max_steps: 7\n", "'max_steps'", "lines 2 and 4"),
    ("data: {src_lang: en, tgt_lang: de, src_lang: fr}\n", "'src_lang'", "lines 1 and 1"),
    ("train:\n  max_steps: 5\ndata:\n  test_prefixes:\n    - {a: 1,\n       a: 2}\n", "'a'", "lines 5 and 6"),
]


@pytest.mark.parametrize("text, key, lines", DUPLICATES, ids=["section", "key", "flow_mapping", "nested"])
def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(text, key, lines, tmp_path, capsys, monkeypatch):
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UserError) as error:
        load_config(path)
    assert key in str(error.value) and lines in str(error.value) and str(path) in str(error.value)
    status, out, err = run_main(dp.main, ["--config", path], capsys, monkeypatch)
    assert_one_line_error(status, err, key, lines)


def test_normal_configs_merge_keys_and_overrides_still_load(tmp_path):
    for name in ("tiny", "multi30k_en_de", "wmt14_en_de_big"):
        assert load_config(ROOT / "configs" / f"{name}.yaml").train.max_steps >= 1
    path = tmp_path / "anchors.yaml"
    path.write_text("train: &t {max_steps: 5, warmup: 2}\ndecode:\n  beam: 3\n"
                    "data: {valid_split: val, test_splits: [a, b]}\n", encoding="utf-8")
    cfg = load_config(path, ["train.max_steps=9", "data.test_splits=[c]"])
    assert (cfg.train.max_steps, cfg.train.warmup, cfg.decode.beam, cfg.data.test_splits) == (9, 2, 3, ["c"])
    path.write_text("data:\n  <<: {src_lang: de, tgt_lang: en}\n  src_lang: fr\n", encoding="utf-8")
    cfg = load_config(path)  # a merge key then an override is not a repetition
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("fr", "en")


def test_yaml_syntax_errors_say_where(tmp_path):
    path = tmp_path / "tabs.yaml"
    path.write_text("data:\n\tsrc_lang: en\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"line 2, column 1"):
        load_config(path)


# ---------------------------------------------------------------- 4. values that would crash later


@pytest.mark.parametrize("overrides, words", [
    (["data.tokenizer=spacy", "data.src_lang=xx1"], ["'xx1'", "data.src_lang"]),
    (["data.tokenizer=spacy", "data.tgt_lang=zz"], ["'zz'"]),
    (["train.seed=-1"], ["train.seed"]),
    ([f"train.seed={2**40}"], ["train.seed"]),
    ([f"data.vocab_size={2**31}"], ["data.vocab_size"]),
    (["data.sample_size=-5"], ["data.sample_size"]),
    (["data.num_workers=-1"], ["data.num_workers"]),
    (["data.valid_split=train"], ["data.valid_split"]),
    (["data.dataset=multi30k", "data.test_splits=[train]"], ["data.test_splits"]),
])
def test_values_that_crash_later_fail_at_validation(overrides, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NMT_DOWNLOAD_URL_BASE", "file:///nonexistent")  # never the network
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    for split in ("train", "val", "test"):  # files for every language used, so that only the value is wrong
        for lang in ("en", "de", "xx1", "zz"):
            shutil.copy(FIXTURES / f"{split}.{lang[:2] if lang == 'de' else 'en'}", tmp_path / f"{split}.{lang}")
    prefixes = {f"{key}_prefix": str(tmp_path / split) for key, split in (("train", "train"), ("valid", "val"))}
    data = fixture_data(tmp_path / "prepared", **prefixes, test_prefixes=[str(tmp_path / "test")])
    config = write_config(tmp_path / "data.yaml", data)
    status, out, err = run_main(dp.main, ["--config", config, *overrides], capsys, monkeypatch)
    assert_one_line_error(status, err, *words)
    assert not (tmp_path / "prepared").exists()


def test_spacy_language_without_its_extra_packages_is_one_line(tmp_path):
    """Japanese exists in spaCy (validation passes) but needs SudachiPy: prepare() must not give a traceback."""
    pytest.importorskip("spacy")
    try:
        import sudachipy  # noqa: F401
        pytest.skip("SudachiPy is installed here: Japanese works")
    except ImportError:
        pass
    for split in ("train", "val"):
        write_corpus(tmp_path, split, fixture_lines(split, "en"), fixture_lines(split, "de"), langs=("ja", "de"))
    cfg = fixture_config(tmp_path / "p", tokenizer="spacy", src_lang="ja", train_prefix=str(tmp_path / "train"),
                         valid_prefix=str(tmp_path / "val"), test_prefixes=[])
    with pytest.raises(UserError, match="cannot tokenize language 'ja'"):
        dp.prepare(cfg)


def test_sentencepiece_errors_are_one_readable_line(tmp_path):
    with pytest.raises(UserError) as error:  # byte fallback alone needs 256 pieces
        dp.prepare(fixture_config(tmp_path, vocab_size=100))
    assert "Vocabulary size is smaller than required_chars" in str(error.value)
    assert "src/" not in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="SentencePiece training failed"):  # prepare() called without validate()
        dp.prepare(fixture_config(tmp_path, vocab_size=2**31))


# ---------------------------------------------------------------- more probes


def test_validation_text_identical_to_training_text_is_refused(tmp_path):
    copy = write_corpus(tmp_path / "c", "copy", fixture_lines("train", "en"), fixture_lines("train", "de"))
    for valid in (str(FIXTURES / "train"), copy):
        with pytest.raises(UserError, match="same text as the training split"):
            dp.prepare(fixture_config(tmp_path / "p", valid_prefix=valid))
    with pytest.raises(UserError, match="split 'copy' has the same text"):
        dp.prepare(fixture_config(tmp_path / "p", test_prefixes=[copy]))


def test_a_damaged_checksum_cache_is_recomputed(tmp_path):
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "input_sha256.json").write_text('{"cut sho', encoding="utf-8")
    folder = dp.prepare(fixture_config(root))
    assert dp.load_split(folder, "train")


def test_crlf_files_give_the_same_data(tmp_path):
    for split in ("train", "val", "test"):
        for lang in ("en", "de"):
            data = (FIXTURES / f"{split}.{lang}").read_bytes().replace(b"\n", b"\r\n")
            (tmp_path / f"{split}.{lang}").write_bytes(data)
    crlf = dp.prepare(fixture_config(tmp_path / "p", train_prefix=str(tmp_path / "train"),
                                     valid_prefix=str(tmp_path / "val"), test_prefixes=[str(tmp_path / "test")]))
    plain = dp.prepare(fixture_config(tmp_path / "q"))
    assert dp.read_raw(crlf, "val", "de") == fixture_lines("val", "de")
    for name in (*TOKENIZER_FILES, "train.src.tokens.npy", "val.tgt.tokens.npy"):
        assert (crlf / name).read_bytes() == (plain / name).read_bytes(), name


def test_config_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffdata:\n  src_lang: de\n  tgt_lang: en\n".encode())
    cfg = load_config(path)
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("de", "en")


def test_not_gzip_raw_file_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NMT_DOWNLOAD_URL_BASE", "file:///nonexistent")  # never the network
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            shutil.copy(FIXTURES / f"{'test' if split.startswith('test') else split}.{lang}", raw / f"{split}.{lang}")
    (raw / "train.en").rename(raw / "train.en.gz")  # plain text named .gz
    config = write_config(tmp_path / "data.yaml", {"dataset": "multi30k", "raw_dir": str(raw), "vocab_size": 400,
                                                   "prepared_dir": str(tmp_path / "p"),
                                                   "test_splits": ["test_2016_flickr"]})
    status, out, err = run_main(dp.main, ["--config", config], capsys, monkeypatch)
    assert_one_line_error(status, err, "train.en.gz")
