"""Robustness (issue 7): every bad input ends in one clear `error:` line on stderr, a non-zero exit, no traceback
and no damaged file; odd translation input always gives one output line per input line; killed training runs
resume from their last complete checkpoint; a diverging run stops cleanly; failed saves keep the old file.

Each category is a table. Most rows run the command's main() in this process through cli_main, exactly as the
script does (the subprocess would only add seconds of imports); one row per category also runs the real script
in a subprocess. A tiny run trained once per module (configs/tiny.yaml) serves the checkpoint tests.
"""

import errno
import gzip
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXTURES, ROOT, fixture_lines, run_in_process

import checkpoint
import data_preparation as dp
import decoding
import train_transformer as tt
import translate as tr
from runtime import UserError, cli_main

ENV = {**os.environ, "NMT_DEBUG": "0", "NMT_NO_TCMALLOC": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("MULTI30K_DIR", None)
MAX_STEPS = 30  # the shared run and the kill/resume run train this many steps
# The shared run: tiny model, one thread, short decoding so that the final report takes a second.
RUN_OVERRIDES = [f"train.max_steps={MAX_STEPS}", "train.eval_every=15", "decode.max_len_a=0", "decode.max_len_b=6"]


# ---------------------------------------------------------------- helpers


def snapshot(*roots) -> dict:
    """sha256 of every file under the given files/folders: equal snapshots = nothing written over."""
    out = {}
    for root in map(Path, roots):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_user_error(status, err: str, message: str, strict: bool = True):
    """Non-zero exit, no traceback, exactly one `error: ...` line (the last one) containing message;
    strict: it is the only line on stderr."""
    assert status not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.split("\n") if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and errors[0] == lines[-1], err
    assert message in errors[0], err
    if strict:
        assert len(lines) == 1, err


def run_main(main, args, capsys, monkeypatch, stdin: bytes | None = None):
    """main(argv) through cli_main in this process: (status, stdout, stderr)."""
    monkeypatch.setenv("NMT_NO_TCMALLOC", "1")  # the trainer would otherwise re-exec this very process
    monkeypatch.setenv("NMT_DEBUG", "0")
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    return run_in_process(main, capsys, *args, monkeypatch=monkeypatch, stdin=stdin)


def script(name, *args, timeout=120, stdin: bytes | None = None, env=None):
    """A repository script in a subprocess, as a user runs it: (status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / name), *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, timeout=timeout, env={**ENV, **(env or {})})
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


def train_args(run, prepared, *extra):
    return ["--config", "configs/tiny.yaml", f"train.out_dir={run}", f"data.prepared_dir={prepared}",
            *RUN_OVERRIDES, *extra]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run dir, prepared dir) of a tiny run trained once by the real script; tests copy it before damaging."""
    root = tmp_path_factory.mktemp("robust")
    status, out, err = script("train_transformer.py", *train_args(root / "run", root / "prepared"), timeout=300)
    assert status == 0, err[-3000:]
    return root / "run", root / "prepared"


# ---------------------------------------------------------------- 1. configuration

BAD_CONFIGS = [  # (overrides or a config file's text, expected words of the message)
    (["train.lr=1"], "unknown key 'train.lr'"),
    (["optim.lr=1"], "unknown config section 'optim'"),
    (["train.max_steps=abc"], "train.max_steps: expected int"),
    (["train.max_steps=2.5"], "train.max_steps: expected int"),
    (["train.resume=maybe"], "train.resume: expected bool"),
    (["max_steps=5"], "must look like section.key=value"),
    (["model.n_heads=3"], "d_model=32 must be divisible by n_heads=3"),
    (["model.attention=gqa", "model.n_heads=4", "model.n_kv_heads=3"], "n_heads=4 must be divisible by n_kv_heads=3"),
    (["train.warmup=0"], "train.warmup must be >= 1"),
    (["model.dropout=-0.1"], "dropout"),
    (["model.attn_dropout=1.0"], "dropout"),
    (["train.lr_factor=.nan"], "train.lr_factor"),
    (["train.lr_factor=.inf"], "train.lr_factor"),
    (["train.lr_factor=-1"], "train.lr_factor must be > 0"),
    (["train.label_smoothing=1.0"], "train.label_smoothing"),
    (["train.rdrop_alpha=-1"], "train.rdrop_alpha"),
    (["train.bpe_dropout=1"], "train.bpe_dropout must be in [0, 1)"),
    (["train.src_token_drop=-0.1"], "train.src_token_drop must be in [0, 1)"),
    (["train.bpe_dropout=0.1", "data.tokenizer=spacy"], "train.bpe_dropout needs data.tokenizer: bpe"),
    (["data.bidirectional=true", "data.tokenizer=spacy"], "data.bidirectional needs data.tokenizer: bpe"),
    (["train.weight_decay=-0.1"], "train.weight_decay"),
    (["train.adam_beta2=1.5"], "train.adam_beta"),
    (["train.device=tpu"], "train.device"),
    (["train.precision=fp8"], "train.precision 'fp8' is unknown"),
    (["train.average_last=5"], "cannot exceed train.keep_last"),
    (["train.max_tokens=0"], "train.max_tokens"),
    (["data.src_lang=de"], "must differ"),
    ("train: {max_steps: 5\n", "is not valid YAML"),
    ("train: !!python/object/apply:os.system ['echo pwned']\n", "is not valid YAML"),
    ("- a list\n- not a mapping\n", "must be a YAML mapping"),
    ("train: 5\n", "section 'train' must be a mapping"),
    (b"data:\n  src_lang: \xe9n\n", "not UTF-8"),
    ("missing", "config file not found"),
    ("directory", "config path is a directory"),
]


@pytest.mark.parametrize("bad, message", BAD_CONFIGS, ids=[f"config{i}" for i in range(len(BAD_CONFIGS))])
def test_bad_config(bad, message, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    if isinstance(bad, list):
        args = ["--config", "configs/tiny.yaml", f"train.out_dir={run}", *bad]
    else:
        path = tmp_path / "bad.yaml"
        if bad == "directory":
            path.mkdir()
        elif bad != "missing":
            path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
        args = ["--config", path, f"train.out_dir={run}"]
    before = snapshot(tmp_path, ROOT / "configs")
    status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert snapshot(tmp_path, ROOT / "configs") == before and not run.exists()


def test_bad_config_from_the_command_line(tmp_path):
    status, out, err = script("train_transformer.py", "--config", "configs/tiny.yaml", "model.n_heads=3",
                              f"train.out_dir={tmp_path}/run")
    assert_user_error(status, err, "divisible by n_heads")


def test_float_strings_in_yaml_are_numbers(tmp_path):
    """YAML 1.1 reads 1e-9 (no dot) as a string; a float field accepts it, anything else is still refused."""
    from config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  adam_eps: 1e-9\n  lr_factor: 2E+0\n", encoding="utf-8")
    cfg = load_config(path, ["train.clip_norm=1e1"])
    assert (cfg.train.adam_eps, cfg.train.lr_factor, cfg.train.clip_norm) == (1e-9, 2.0, 10.0)
    with pytest.raises(UserError, match="expected float"):
        load_config(path, ["train.clip_norm=big"])


# ---------------------------------------------------------------- 2. data files


def data_case(case: str, tmp: Path, monkeypatch) -> dict:
    """Write a damaged copy of the fixture corpus for one case; returns the data section to use."""
    corpus = tmp / "corpus"
    corpus.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("en", "de"):
            shutil.copy(FIXTURES / f"{split}.{lang}", corpus / f"{split}.{lang}")
    data = {"dataset": "files", "src_lang": "en", "tgt_lang": "de", "tokenizer": "bpe", "vocab_size": 400,
            "prepared_dir": str(tmp / "prepared"), "train_prefix": str(corpus / "train"),
            "valid_prefix": str(corpus / "val"), "test_prefixes": [str(corpus / "test")], "valid_split": "val"}
    train_de = corpus / "train.de"
    if case == "missing":
        train_de.unlink()
    elif case == "directory":
        train_de.unlink()
        train_de.mkdir()
    elif case == "fewer_lines":
        train_de.write_text("".join(f"{line}\n" for line in fixture_lines("train", "de")[:-3]), encoding="utf-8")
    elif case == "truncated_mid_line":
        train_de.write_bytes(train_de.read_bytes()[:500])
    elif case == "truncated_mid_char":  # both sides get a 41st line; the German one ends in half a character
        with open(corpus / "train.en", "a", encoding="utf-8") as f:
            f.write("Green.")
        with open(train_de, "ab") as f:
            f.write("Grün".encode()[:3])
    elif case == "latin1":
        text = "".join(f"{line}\n" for line in fixture_lines("train", "de"))
        train_de.write_bytes(text.encode("latin-1", errors="replace"))
    elif case == "empty":
        train_de.write_text("", encoding="utf-8")
        (corpus / "train.en").write_text("", encoding="utf-8")
    elif case == "blank":
        train_de.write_text("\n \n\t\n", encoding="utf-8")
        (corpus / "train.en").write_text("a\nb\nc\n", encoding="utf-8")
    elif case == "prepared_is_file":
        (tmp / "prepared").write_text("not a folder", encoding="utf-8")
    elif case == "truncated_gz":
        monkeypatch.setenv("NMT_DOWNLOAD_URL_BASE", "file:///nonexistent")  # never the network
        raw = tmp / "raw"
        raw.mkdir()
        for split in ("train", "val", "test_2016_flickr"):
            for lang in ("en", "de"):
                src = FIXTURES / f"{'test' if split.startswith('test') else split}.{lang}"
                shutil.copy(src, raw / f"{split}.{lang}")
        (raw / "train.en").unlink()
        blob = gzip.compress((FIXTURES / "train.en").read_bytes())
        (raw / "train.en.gz").write_bytes(blob[: len(blob) // 2])
        data = {"dataset": "multi30k", "src_lang": "en", "tgt_lang": "de", "raw_dir": str(raw),
                "prepared_dir": str(tmp / "prepared"), "vocab_size": 400, "test_splits": ["test_2016_flickr"]}
    else:
        raise AssertionError(case)
    path = tmp / "data.yaml"
    path.write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    return data


BAD_DATA = [  # (case, expected words of the message)
    ("missing", "data file not found"),
    ("directory", "train.de"),
    ("fewer_lines", "line-aligned"),
    ("truncated_mid_line", "line-aligned"),
    ("truncated_mid_char", "line 41 is not valid UTF-8"),
    ("latin1", "not valid UTF-8"),
    ("truncated_gz", "train.en.gz"),
    ("empty", "no non-blank line"),
    ("blank", "no non-blank line"),
    ("prepared_is_file", "prepared"),
]


@pytest.mark.parametrize("case, message", BAD_DATA, ids=[c for c, _ in BAD_DATA])
def test_bad_data(case, message, tmp_path, capsys, monkeypatch):
    data_case(case, tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    status, out, err = run_main(dp.main, ["--config", tmp_path / "data.yaml"], capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert snapshot(tmp_path) == before


def test_bad_data_from_the_command_line(tmp_path, monkeypatch):
    data_case("latin1", tmp_path, monkeypatch)
    status, out, err = script("data_preparation.py", "--config", tmp_path / "data.yaml")
    assert_user_error(status, err, "line 1 is not valid UTF-8")


@pytest.mark.parametrize("case, message", [
    ("all_too_long", "no training pairs"),  # every pair filtered away: the trainer must not spin forever
    ("empty_valid", "validation"),  # found at the first evaluation, after hours of training, unless checked
])
def test_data_that_cannot_train(case, message, tmp_path, capsys, monkeypatch):
    data = data_case("fewer_lines", tmp_path, monkeypatch)
    corpus = tmp_path / "corpus"
    shutil.copy(FIXTURES / "train.de", corpus / "train.de")
    extra = []
    if case == "all_too_long":
        extra = ["data.max_len=2"]
    else:
        (corpus / "val.en").write_text("", encoding="utf-8")
        (corpus / "val.de").write_text("", encoding="utf-8")
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={tmp_path / 'run'}",
            f"data.prepared_dir={data['prepared_dir']}", f"data.train_prefix={data['train_prefix']}",
            f"data.valid_prefix={data['valid_prefix']}", "data.test_prefixes=[]", *extra]
    if case == "all_too_long":  # a subprocess, so that a regression (an endless loop) cannot hang the suite
        status, out, err = script("train_transformer.py", *args, timeout=60)
    else:
        status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert not list((tmp_path / "run").glob("checkpoint_*"))


# ---------------------------------------------------------------- 3. run directory and resuming


def damage_run(case: str, run: Path, tmp: Path) -> list[str]:
    """Damage a copy of a finished run for one case; returns the extra trainer arguments."""
    last = run / "checkpoint_last.pt"
    resume = ["train.resume=true", f"train.max_steps={MAX_STEPS + 5}"]
    if case == "holds_a_run":
        return []
    if case == "resume_and_overwrite":
        return ["--resume", "--overwrite"]
    if case == "out_dir_is_file":
        shutil.rmtree(run)
        run.write_text("a file", encoding="utf-8")
        return []
    if case == "out_dir_under_a_file":
        (tmp / "afile").write_text("x", encoding="utf-8")
        return [f"train.out_dir={tmp / 'afile' / 'run'}"]
    if case == "resume_without_checkpoint":
        last.unlink()
        return resume
    if case == "resume_other_model":
        return [*resume, "model.d_ff=128"]
    if case == "resume_other_tokenizer":
        return [*resume, "data.vocab_size=300"]
    if case == "resume_other_direction":  # the reverse direction's data: another tokenizer for the same model
        return [*resume, "data.src_lang=de", "data.tgt_lang=en"]
    if case == "resume_other_model_no_config":
        (run / "config.yaml").unlink()
        return [*resume, "model.d_ff=128"]
    if case == "resume_truncated":
        last.write_bytes(last.read_bytes()[:4000])
    elif case == "resume_empty_file":
        last.write_bytes(b"")
    elif case == "resume_garbage":
        last.write_bytes(os.urandom(3000))
    elif case == "resume_directory":
        last.unlink()
        last.mkdir()
    elif case == "resume_unsafe_pickle":
        torch.save({"model": {}, "step": 1, "rng": Path("x")}, last)  # a class: refused by weights_only
    elif case == "resume_model_only":
        shutil.copy(run / "checkpoint_best.pt", last)  # no optimizer or data position in it
    elif case == "resume_bad_config_yaml":
        (run / "config.yaml").write_text("model: [unclosed\n", encoding="utf-8")
    else:
        raise AssertionError(case)
    return resume


BAD_RUNS = [  # (case, expected words of the message)
    ("holds_a_run", "already holds a run"),
    ("resume_and_overwrite", "not both"),
    ("out_dir_is_file", "is a file"),
    ("out_dir_under_a_file", "train.out_dir"),
    ("resume_without_checkpoint", "does not exist"),
    ("resume_other_model", "another model config"),
    ("resume_other_tokenizer", "another"),
    ("resume_other_direction", "another"),
    ("resume_other_model_no_config", "does not match this model config"),
    ("resume_truncated", "truncated or corrupt"),
    ("resume_empty_file", "truncated or corrupt"),
    ("resume_garbage", "truncated or corrupt"),
    ("resume_directory", "is a directory"),
    ("resume_unsafe_pickle", "refusing to load"),
    ("resume_model_only", "not a full training checkpoint"),
    ("resume_bad_config_yaml", "not a readable config"),
]


@pytest.mark.parametrize("case, message", BAD_RUNS, ids=[c for c, _ in BAD_RUNS])
def test_bad_run_dir(case, message, trained, run_copy, tmp_path, capsys, monkeypatch):
    extra = damage_run(case, run_copy, tmp_path)
    before = snapshot(tmp_path)
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={run_copy}", f"data.prepared_dir={trained[1]}",
            *RUN_OVERRIDES, *extra]
    status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert snapshot(tmp_path) == before


def test_resume_a_run_saved_before_a_model_field_existed(trained, run_copy, capsys, monkeypatch):
    """A run whose config.yaml predates a model field (here output_vocab and output_size, added later) resumes:
    the field's default is what the older code did; a field that differs is still refused (resume_other_model)."""
    saved = yaml.safe_load((run_copy / "config.yaml").read_text(encoding="utf-8"))
    del saved["model"]["output_vocab"], saved["model"]["output_size"]
    (run_copy / "config.yaml").write_text(yaml.safe_dump(saved), encoding="utf-8")
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={run_copy}", f"data.prepared_dir={trained[1]}",
            *RUN_OVERRIDES, f"train.max_steps={MAX_STEPS + 5}", "--resume"]
    status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert status == 0, err[-2000:]
    assert checkpoint.read_checkpoint(run_copy / "checkpoint_last.pt")["step"] == MAX_STEPS + 5


def test_run_dir_from_the_command_line(trained, run_copy):
    before = snapshot(run_copy)
    status, out, err = script("train_transformer.py", *train_args(run_copy, trained[1]))
    assert_user_error(status, err, "already holds a run")
    assert snapshot(run_copy) == before


# ---------------------------------------------------------------- 4. checkpoints and tokenizers for translate


def damage_checkpoint(case: str, run: Path, tmp: Path) -> list:
    """Damage a copy of a run for translate.py; returns the arguments to pass."""
    last = checkpoint.find_checkpoint(run)  # the file translate.py reads: avg or best, whichever the run kept
    args = ["--checkpoint", run, "A dog runs."]
    if case == "truncated":
        last.write_bytes(last.read_bytes()[:3000])
    elif case == "empty_file":
        last.write_bytes(b"")
    elif case == "garbage":
        last.write_bytes(b"PK\x03\x04" + os.urandom(2000))
    elif case == "directory":
        last.unlink()
        last.mkdir()
    elif case == "unsafe_pickle":
        torch.save({"model": {}, "config": {}, "hook": Path("x")}, last)
    elif case == "not_a_checkpoint":
        torch.save([1, 2, 3], last)
    elif case in ("other_model", "nan_weights", "other_tokenizer_same_size"):
        state = torch.load(last, weights_only=True)
        if case == "other_model":
            state["config"]["model"]["n_enc_layers"] = 2
        elif case == "nan_weights":
            next(iter(state["model"].values())).fill_(float("nan"))
        torch.save(state, last)
        if case == "other_tokenizer_same_size":  # the reverse direction's tokenizer: same pieces, wrong run
            info = json.loads((run / "tokenizer" / "tokenizer.json").read_text("utf-8"))
            info["src_lang"], info["tgt_lang"] = info["tgt_lang"], info["src_lang"]
            (run / "tokenizer" / "tokenizer.json").write_text(json.dumps(info), encoding="utf-8")
    elif case == "no_tokenizer":
        shutil.rmtree(run / "tokenizer")
    elif case == "tokenizer_json_corrupt":
        (run / "tokenizer" / "tokenizer.json").write_text("{not json", encoding="utf-8")
    elif case == "spm_model_truncated":
        spm = run / "tokenizer" / "spm.model"
        spm.write_bytes(spm.read_bytes()[:100])
    elif case == "output_is_directory":
        (tmp / "out").mkdir()
        args += ["--output", tmp / "out"]
    elif case == "output_is_input":
        (tmp / "in.txt").write_text("A dog.\n", encoding="utf-8")
        args = ["--checkpoint", run, "--input", tmp / "in.txt", "--output", tmp / "in.txt"]
    elif case == "output_is_checkpoint":
        args += ["--output", last]
    elif case == "plot_is_directory":
        (tmp / "plot.png").mkdir()
        args += ["--plot-attention", tmp / "plot.png"]
    elif case == "input_is_directory":
        args = ["--checkpoint", run, "--input", tmp]
    elif case == "input_latin1":
        (tmp / "in.txt").write_bytes("Un été\n".encode("latin-1"))
        args = ["--checkpoint", run, "--input", tmp / "in.txt"]
    elif case == "reference_line_count":
        (tmp / "ref.txt").write_text("one\ntwo\n", encoding="utf-8")
        args += ["--reference", tmp / "ref.txt"]
    elif case == "stdin_latin1_keeps_old_output":
        (tmp / "out.txt").write_text("an earlier result\n", encoding="utf-8")
        args = ["--checkpoint", run, "--output", tmp / "out.txt"]
    else:
        raise AssertionError(case)
    return args


BAD_CHECKPOINTS = [  # (case, expected words of the message)
    ("truncated", "cannot read checkpoint"),
    ("empty_file", "cannot read checkpoint"),
    ("garbage", "cannot read checkpoint"),
    ("directory", "is a directory"),
    ("unsafe_pickle", "refusing to load"),
    ("not_a_checkpoint", "not a checkpoint of this project"),
    ("other_model", "does not match its model config"),
    ("nan_weights", "non-finite"),
    ("other_tokenizer_same_size", "tokenizer"),
    ("no_tokenizer", "tokenizer folder not found"),
    ("tokenizer_json_corrupt", "cannot load the tokenizer"),
    ("spm_model_truncated", "cannot load the tokenizer"),
    ("output_is_directory", "is a directory"),
    ("output_is_input", "--output"),
    ("output_is_checkpoint", "--output"),
    ("plot_is_directory", "is a directory"),
    ("input_is_directory", "is a directory"),
    ("input_latin1", "not UTF-8"),
    ("reference_line_count", "reference lines"),
    ("stdin_latin1_keeps_old_output", "not UTF-8"),
]


@pytest.mark.parametrize("case, message", BAD_CHECKPOINTS, ids=[c for c, _ in BAD_CHECKPOINTS])
def test_bad_checkpoint_or_translate_argument(case, message, run_copy, tmp_path, capsys, monkeypatch):
    args = damage_checkpoint(case, run_copy, tmp_path)
    stdin = b"A dog.\nUn \xe9t\xe9\n" if case.startswith("stdin") else None
    before = snapshot(tmp_path)
    status, out, err = run_main(tr.main, args, capsys, monkeypatch, stdin=stdin)
    assert_user_error(status, err, message)
    assert snapshot(tmp_path) == before
    if case.startswith("stdin"):
        assert not list(tmp_path.glob("out.txt.*")), "a temporary output file was left behind"


def test_truncated_checkpoint_from_the_command_line(run_copy):
    last = checkpoint.find_checkpoint(run_copy)
    last.write_bytes(last.read_bytes()[:5000])
    status, out, err = script("translate.py", "--checkpoint", run_copy, "A dog.")
    assert_user_error(status, err, "cannot read checkpoint")


# ---------------------------------------------------------------- 5. odd translation input

LONG_LINE = " ".join(["dog"] * 5000)
ODD_LINES = {
    "empty": "",
    "spaces": "    ",
    "tab": "\t",
    "long_5000_words": LONG_LINE,
    "long_single_token": "x" * 20000,
    "control": "A \x00dog\x01 \x1b[31mruns\x07\x08.",
    "form_feed_vtab": "A\x0cdog\x0bruns.",
    "lone_cr": "A dog\rruns.",
    "unicode_line_breaks": "A dog\u2028runs\u2029fast\x85.",
    "emoji": "😀🐕 runs 👩‍👩‍👧‍👦",
    "mixed_scripts": "Der Hund 犬 собака كلب कुत्ता runs.",
    "bidi_zero_width": "\u202eA dog\u200b\u200d runs\ufeff.",
    "combining": "Cafe\u0301 e\u0308\u0308\u0308",
}


@pytest.mark.parametrize("name", list(ODD_LINES))
def test_odd_translation_input_gives_one_line_per_line(name, run_copy, tmp_path, capsys, monkeypatch):
    """The odd line sits between two normal ones, in a file with Windows line endings."""
    src = tmp_path / "in.txt"
    src.write_bytes(("A man.\r\n" + ODD_LINES[name] + "\r\nTwo dogs.\r\n").encode("utf-8"))
    out = tmp_path / "out.txt"
    status, stdout, err = run_main(tr.main, ["--checkpoint", run_copy, "--input", src, "--output", out,
                                             "--beam", "2"], capsys, monkeypatch)
    assert status == 0 and "Traceback" not in err, err
    text = out.read_text("utf-8")
    assert text.endswith("\n") and len(text.split("\n")) == 4 and len(text.splitlines()) == 3, repr(text)
    first, middle, last = text.splitlines()
    assert first and last  # the neighbours still translate
    if not ODD_LINES[name].strip():
        assert middle == ""
    if name.startswith("long"):
        assert "warning: input line 2 has" in err and "translating its first" in err


def test_odd_input_on_stdin_of_the_script(run_copy):
    lines = list(ODD_LINES.values())
    status, out, err = script("translate.py", "--checkpoint", run_copy, "--beam", "1",
                              stdin="\r\n".join(lines).encode("utf-8"))
    assert status == 0 and "Traceback" not in err, err
    assert out.endswith("\n") and len(out.splitlines()) == len(lines) == len(out.split("\n")) - 1, repr(out)
    assert "warning: input line 4 has" in err


# ---------------------------------------------------------------- 6. saving: disk full, permission denied


def fail_with(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


SAVE_FAILURES = [  # (what fails, with what, expected words)
    ("torch.save", errno.ENOSPC, "No space left on device"),
    ("os.replace", errno.EACCES, "Permission denied"),
    ("os.fsync", errno.EIO, "Input/output error"),
    ("open", errno.EROFS, "Read-only file system"),
    ("interrupt", None, "interrupted"),
]


@pytest.mark.parametrize("what, code, message", SAVE_FAILURES, ids=[w for w, _, _ in SAVE_FAILURES])
def test_failed_save_keeps_the_previous_checkpoint(what, code, message, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_last.pt"
    checkpoint.save_checkpoint({"model": {"w": torch.ones(3)}, "step": 1}, path)
    before = snapshot(tmp_path)
    if what == "torch.save":
        monkeypatch.setattr(torch, "save", fail_with(code))
    elif what == "os.replace":
        monkeypatch.setattr(os, "replace", fail_with(code))
    elif what == "os.fsync":
        monkeypatch.setattr(os, "fsync", fail_with(code))
    elif what == "open":
        monkeypatch.setattr("builtins.open", fail_with(code))
    else:
        def interrupted(obj, f, *a, **k):
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt
        monkeypatch.setattr(torch, "save", interrupted)
    state = {"model": {"w": torch.zeros(3)}, "step": 2}
    if what == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_checkpoint(state, path)
    else:
        with pytest.raises(UserError, match=f"could not write .*checkpoint_last.pt: {message}.*previous"):
            checkpoint.save_checkpoint(state, path)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before  # same file, same bytes, no temporary file left
    assert checkpoint.read_checkpoint(path)["step"] == 1


def test_os_errors_become_one_line(capsys):
    """A last line of defence: an OSError nobody anticipated is still one line, not a traceback."""
    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/some/file")
    with pytest.raises(SystemExit) as e:
        cli_main(main, [])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert_user_error(e.value.code, err, "No space left on device")
    assert "/some/file" in err


# ---------------------------------------------------------------- 7. non-finite losses


@pytest.mark.slow
def test_nan_loss_stops_training_and_keeps_the_last_checkpoint(trained, run_copy):
    """A learning rate of 1e30 is a real cause: one update blows the weights up, every next loss is NaN."""
    before = snapshot(*run_copy.glob("checkpoint_*.pt"))
    status, out, err = script("train_transformer.py", *train_args(
        run_copy, trained[1], "train.resume=true", f"train.max_steps={MAX_STEPS + 20}", "train.lr_factor=1e30",
        "train.max_bad_steps=3", "train.eval_every=1000"))
    assert_user_error(status, err, "training diverged: 3 non-finite", strict=False)
    assert f"checkpoint_last.pt (step {MAX_STEPS})" in err
    assert err.count("update skipped") == 3
    assert snapshot(*run_copy.glob("checkpoint_*.pt")) == before
    assert checkpoint.read_checkpoint(run_copy / "checkpoint_last.pt")["step"] == MAX_STEPS


# ---------------------------------------------------------------- 8. killed at random moments, resumed


# Runs train_transformer.py with torch.save wrapped: its N-th call writes half the bytes, then SIGKILLs the process,
# the worst moment for a power cut. The wrapper lives here, not in the shipped code.
DIE_IN_SAVE = """
import io, os, runpy, signal, sys
import torch
die_at, calls, real_save = int(sys.argv.pop(1)), [0], torch.save
def dying_save(obj, f, *args, **kwargs):
    calls[0] += 1
    if calls[0] != die_at:
        return real_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    f.write(buf.getvalue()[: buf.tell() // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
sys.argv[0] = sys.argv.pop(1)
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def wait_for_new_save(proc, last: Path, after_ns: int, timeout: float = 120) -> bool:
    """True once checkpoint_last.pt was rewritten after after_ns; False if the process ended first."""
    end = time.time() + timeout
    while time.time() < end:
        if last.exists() and last.stat().st_mtime_ns > after_ns:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError("no checkpoint written in time")


@pytest.mark.slow
def test_kill_at_random_moments_and_resume(trained, tmp_path):
    """SIGKILL in the middle of a checkpoint write (DIE_IN_SAVE), SIGKILL/SIGTERM/SIGINT at random moments with a
    checkpoint every step: each time checkpoint_last.pt loads, the next start resumes from its step, and the
    run ends with the same weights as the uninterrupted one."""
    rng = random.Random(1234)
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoint_last.pt"
    plan = [("in_save", 4), ("SIGKILL", None), ("SIGTERM", None), ("in_save", 2), ("SIGINT", None), ("SIGKILL", None)]
    kills, resumes, expected_step = 0, 0, None
    wrapper = tmp_path / "die_in_save.py"
    wrapper.write_text(DIE_IN_SAVE)
    for i, (how, arg) in enumerate(plan + [("finish", None)]):
        extra = ["train.save_every=1"] + (["--resume"] if i else [])
        script = [str(wrapper), str(arg)] if how == "in_save" else []
        log = tmp_path / f"stderr{i}.txt"
        mtime = last.stat().st_mtime_ns if last.exists() else 0
        with open(log, "w") as err_file:
            proc = subprocess.Popen([sys.executable, *script, str(ROOT / "train_transformer.py"),
                                     *train_args(run, trained[1], *extra)], cwd=ROOT, env=ENV,
                                    stdout=subprocess.DEVNULL, stderr=err_file)
            try:
                if how not in ("in_save", "finish") and wait_for_new_save(proc, last, mtime):
                    time.sleep(rng.uniform(0.0, 0.08))  # a step (with its save) takes ~30 ms
                    proc.send_signal(getattr(signal, how))
                status = proc.wait(timeout=300)
            finally:
                proc.kill()
        err = log.read_text()
        if expected_step is not None:
            resumes += f"resumed from step {expected_step} " in err
            assert f"resumed from step {expected_step} " in err, err[-2000:]
        if how == "finish" or status == 0:
            assert status == 0, err[-2000:]
            break
        kills += 1
        assert "Traceback" not in err, err[-2000:]
        assert status == {"SIGTERM": 143, "SIGINT": 130}.get(how, -signal.SIGKILL), (how, status, err[-2000:])
        expected_step = checkpoint.read_checkpoint(last)["step"]  # complete and loadable after every kill
        if how == "in_save":
            assert list(run.glob("checkpoint_*.pt.tmp*")), "DIE_IN_SAVE did not kill the process inside a save"
        if how in ("SIGTERM", "SIGINT"):
            assert f"saved checkpoint_last.pt at step {expected_step}" in err, err[-2000:]
        print(f"kill {kills}: {how} -> exit {status}, checkpoint_last.pt complete at step {expected_step}")
    assert kills >= 5 and resumes == kills, (kills, resumes)
    final, reference = checkpoint.read_checkpoint(last), checkpoint.read_checkpoint(trained[0] / "checkpoint_last.pt")
    assert final["step"] == MAX_STEPS and not list(run.glob("*.tmp*"))
    for k, v in reference["model"].items():
        torch.testing.assert_close(final["model"][k], v, rtol=0, atol=0, msg=k)
    model, tokenizer, _ = checkpoint.load_checkpoint(run)
    assert len(decoding.translate_texts(model, tokenizer, ["A dog runs.", ""], beam=1, max_len_b=5)) == 2
