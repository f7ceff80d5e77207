"""Shared test helpers: the shipped fixture corpus, configs that point at it, Multi30k, running a script."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # hand-written en/de pairs: train 40, val 12, test 10
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def fixture_lines(split: str, lang: str) -> list[str]:
    return (FIXTURES / f"{split}.{lang}").read_text("utf-8").split("\n")[:-1]


def fixture_data(prepared_dir, **overrides) -> dict:
    """The data: section of a config using the fixture corpus (dataset 'files'), as plain values."""
    data = {"dataset": "files", "src_lang": "en", "tgt_lang": "de", "prepared_dir": str(prepared_dir),
            "tokenizer": "bpe", "vocab_size": 400, "min_freq": 2, "valid_split": "val",
            "train_prefix": str(FIXTURES / "train"), "valid_prefix": str(FIXTURES / "val"),
            "test_prefixes": [str(FIXTURES / "test")]}
    return {**data, **overrides}


def fixture_config(prepared_dir, **overrides):
    """A DataConfig for the fixture corpus; tiny BPE vocabulary so SentencePiece trains in milliseconds."""
    from config import DataConfig

    return DataConfig(**fixture_data(prepared_dir, **overrides))


def write_corpus(folder: Path, split: str, src: list[str], tgt: list[str], langs=("en", "de")) -> str:
    """Write {folder}/{split}.{lang} files and return the prefix, for the 'files' dataset."""
    folder.mkdir(parents=True, exist_ok=True)
    for lang, lines in zip(langs, (src, tgt), strict=True):
        (folder / f"{split}.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(folder / split)


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    return path


def start_script(script: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a repository script the way a user does; several can run at once."""
    env = {**os.environ, "NMT_DEBUG": "0", **(env or {})}
    return subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_script(script: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return finish(start_script(script, *args, cwd=cwd, env=env))


def run_in_process(main, capsys, *args, monkeypatch=None, stdin: bytes | None = None) -> tuple:
    """A script's main in this process through cli_main, as the script runs it: (status, stdout, stderr)."""
    from runtime import cli_main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    capsys.readouterr()
    try:
        status = cli_main(main, [str(a) for a in args]) or 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def multi30k_dir() -> Path | None:
    """The Multi30k raw folder from MULTI30K_DIR (CI: ../shared/data/multi30k), or None when unavailable."""
    value = os.environ.get("MULTI30K_DIR")
    return Path(value).resolve() if value and Path(value).is_dir() else None


@pytest.fixture
def multi30k() -> Path:
    folder = multi30k_dir()
    if folder is None:
        pytest.skip("real-data test: set MULTI30K_DIR to the Multi30k raw folder")
    return folder


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and the test machine is shared; restored afterwards.
    Test modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def unexplained_differences(model, tokenizer, lines: list[str], theirs: list[str], beam: int, len_penalty: float,
                            max_len_a: float, max_len_b: float) -> list[tuple[str, str, str]]:
    """(line, ours, theirs) for each line where another engine's best translation differs from our beam search's,
    except the one documented case (ct2_engine docstring): our best hypothesis runs to the maximum length, where
    CTranslate2 keeps only some of the beams, so its best must then be one of our n-best list."""
    import torch

    import decoding

    found = decoding.search_texts(model, tokenizer, lines, beam=beam, len_penalty=len_penalty, max_len_a=max_len_a,
                                  max_len_b=max_len_b, nbest=beam, greedy_ok=False)
    problems = []
    for line, hyps, their in zip(lines, found, theirs, strict=True):
        ours = [tokenizer.decode_tgt(ids) for ids, _ in hyps]
        if their == ours[0]:
            continue
        source = torch.ones(1, len(tokenizer.encode_src(line)))  # (1,S) real tokens, eos included
        limit = int(decoding.max_lengths(model, source, max_len_a, max_len_b))
        if not (len(hyps[0][0]) == limit and their in ours):
            problems.append((line, ours[0], their))
    return problems


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The run directory of configs/tiny.yaml trained once per session by the real script (seconds, one thread).
    Tests only read it (translate, export, serve); a test that changes a run trains its own."""
    root = tmp_path_factory.mktemp("tiny_run")
    proc = run_script("train_transformer.py", "--config", "configs/tiny.yaml", f"train.out_dir={root / 'run'}",
                      f"data.prepared_dir={root / 'prepared'}", cwd=ROOT,
                      env={**os.environ, "OMP_NUM_THREADS": "1", "NMT_DEBUG": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def translator(tiny_run):
    """The tiny run loaded through the Python API (translator.Translator), once per module."""
    from translator import Translator

    return Translator.load(tiny_run, device="cpu")


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the run of the requesting module's own `trained` fixture ((run dir, prepared dir)), for a test
    to damage."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    return run
