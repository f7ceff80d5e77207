"""Tests of the engine choice (Translator.load, translate.py --engine), standard input read in chunks, and the
decode precision shared by the training report and translate.py, on the tiny run of configs/tiny.yaml."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys

import pytest
from conftest import ROOT, fixture_lines, run_in_process, unexplained_differences

import checkpoint
import ct2_engine
import evaluation
import translate as tr
from config import config_from_dict, validate
from runtime import UserError
from translator import Translation, Translator

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCES = fixture_lines("test", "en") + fixture_lines("val", "en")
LINES = [*SOURCES[:5], "", "   ", *SOURCES[5:]]  # blank lines give blank lines, with both engines
CLI_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1",
           "NMT_DEBUG": "0"}


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    """The tiny run exported to CTranslate2 (float32), as export.py writes it."""
    pytest.importorskip("ctranslate2")
    import export

    return export.export_ctranslate2(tiny_run, tmp_path_factory.mktemp("engines") / "ct2")


@pytest.fixture(scope="module")
def input_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "in.en"
    path.write_text("".join(f"{line}\n" for line in LINES), encoding="utf-8")
    return path


def run_main(capsys, monkeypatch, *args, stdin: bytes | None = None):
    """translate.main in this process, as the script runs it: (status, stdout, stderr)."""
    return run_in_process(tr.main, capsys, *args, monkeypatch=monkeypatch, stdin=stdin)


def same_share(a: list[str], b: list[str]) -> float:
    assert len(a) == len(b)
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


# ---------------------------------------------------------------- the engine choice


def test_auto_picks_the_engine_by_path_and_mismatches_are_one_line(tiny_run, exported):
    assert Translator.load(tiny_run, device="cpu").engine == "torch"
    ct2 = Translator.load(exported, device="cpu")
    assert (ct2.engine, ct2.name, ct2.precision, ct2.default_beam) == ("ctranslate2", "ct2", "float32", 2)
    with pytest.raises(UserError, match="is a CTranslate2 export, it holds no PyTorch weights"):
        Translator.load(exported, engine="torch")
    with pytest.raises(UserError, match=r"^\S+ is not a CTranslate2 export .*python export.py --checkpoint"):
        Translator.load(tiny_run, engine="ctranslate2")
    with pytest.raises(UserError, match="use_cache=False .* needs engine torch"):
        Translator.load(exported, use_cache=False)


@pytest.mark.parametrize("beam,nbest", [(1, 1), (2, 2), (4, 3)])
def test_both_engines_give_the_same_translations_and_types(tiny_run, exported, beam, nbest):
    torch_tr, ct2_tr = Translator.load(tiny_run, device="cpu"), Translator.load(exported, device="cpu")
    ours, theirs = (t.translate(LINES, beam=beam, nbest=nbest) for t in (torch_tr, ct2_tr))
    if beam == 1:
        assert same_share([t.text for t in ours], [t.text for t in theirs]) == 1.0
    else:
        d = torch_tr.cfg.decode
        assert unexplained_differences(torch_tr.model, torch_tr.tokenizer, LINES, [t.text for t in theirs], beam,
                                       d.len_penalty, d.max_len_a, d.max_len_b) == []
    for a, b, line in zip(ours, theirs, LINES, strict=True):
        assert isinstance(b, Translation) and type(a.text) is type(b.text) is str
        assert type(a.score) is type(b.score)  # None for greedy search, else float
        assert len(a.hypotheses) == len(b.hypotheses) == (nbest if line.strip() else 1)
        assert all(isinstance(h, str) and (s is None or isinstance(s, float)) for h, s in b.hypotheses)
        if not line.strip():
            assert a.hypotheses == b.hypotheses == [("", 0.0)]
    with pytest.raises(ValueError, match="attention=True needs engine torch; this Translator runs ctranslate2"):
        ct2_tr.translate(LINES[:1], attention=True)


def test_ctranslate2_compute_types(exported):
    import ctranslate2

    info = ct2_engine.read_info(exported)
    cpu = Translator.load(exported, device="cpu").device
    assert ct2_engine.compute_type(None, info, cpu) == "float32"  # the run's decode.precision, fp32
    assert ct2_engine.compute_type(None, {**info, "quantization": "int8"}, cpu) == "default"  # kept as exported
    assert ct2_engine.compute_type("auto", info, cpu) in ("float32", "bfloat16")
    if "bfloat16" in ctranslate2.get_supported_compute_types("cpu"):
        assert ct2_engine.compute_type("bf16", info, cpu) == "bfloat16"
    else:
        with pytest.raises(UserError, match="CTranslate2 cannot compute in bfloat16 on cpu here"):
            ct2_engine.compute_type("bf16", info, cpu)
    int8 = Translator.load(exported, device="cpu", precision="int8")
    assert int8.precision.startswith("int8")
    assert all(t.text for t in int8.translate(SOURCES[:3]))


# ---------------------------------------------------------------- translate.py with both engines


def test_cli_outputs_are_the_same_with_both_engines(tiny_run, exported, input_file, tmp_path, capsys,
                                                    monkeypatch):
    """Greedy identical line for line; beam search (default beam 2, and beam 4 with another penalty) too, except
    where ours runs to the maximum length (unexplained_differences)."""
    net, tok, cfg = checkpoint.load_checkpoint(tiny_run)
    d = cfg.decode
    for options, search in ((["--beam", "1"], None), ([], (d.beam, d.len_penalty, d.max_len_a, d.max_len_b)),
                            (["--beam", "4", "--len-penalty", "1.0", "--max-len-b", "12"], (4, 1.0, d.max_len_a, 12))):
        outputs = []
        for engine, model in (("torch", tiny_run), ("ctranslate2", exported)):
            out = tmp_path / f"{engine}.de"
            status, _, err = run_main(capsys, monkeypatch, "--checkpoint", model, "--engine", engine,
                                      "--input", input_file, "--output", out, *options)
            assert status == 0, err
            outputs.append(out.read_text("utf-8").split("\n"))
        assert len(outputs[0]) == len(LINES) + 1 and outputs[0][5:7] == outputs[1][5:7] == ["", ""]
        if search is None:
            assert same_share(*outputs) == 1.0
        else:
            assert unexplained_differences(net, tok, LINES, outputs[1][:len(LINES)], *search) == []


def test_cli_reference_json_and_nbest_with_ctranslate2(tiny_run, exported, tmp_path, capsys, monkeypatch):
    scores, hyps = [], []
    for model in (tiny_run, exported):  # --engine auto: torch for the run, ctranslate2 for the export
        out_file = tmp_path / f"{model.name}.de"
        status, out, err = run_main(capsys, monkeypatch, "--checkpoint", model, "--reference", "test", "--json",
                                    "--output", out_file)
        assert status == 0, err
        scores.append(json.loads(out))
        hyps.append(out_file.read_text("utf-8").splitlines())
    assert scores[1]["sentences"] == 10 and {"bleu", "chrf", "bleu_tok_lc", "signature"} <= set(scores[1])
    net, tok, cfg = checkpoint.load_checkpoint(tiny_run)
    d = cfg.decode
    assert unexplained_differences(net, tok, fixture_lines("test", "en"), hyps[1], d.beam, d.len_penalty,
                                   d.max_len_a, d.max_len_b) == []
    assert hyps[0] != hyps[1] or scores[0] == scores[1]
    status, out, err = run_main(capsys, monkeypatch, "--checkpoint", exported, "--reference", "test",
                                "--input", ROOT / "tests" / "fixtures" / "test.en", "--output", tmp_path / "h.de")
    assert status == 0 and "BLEU (cased, detokenized)" in out, err
    status, out, err = run_main(capsys, monkeypatch, "--checkpoint", exported, "--nbest", "2", "A cat.", "",
                                "Two men.")
    assert status == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "2", "2"] and rows[2][1:] == ["0.0000", ""]
    assert float(rows[0][1]) >= float(rows[1][1])


@pytest.mark.parametrize("args,message", [
    (["--plot-attention", "x.png", "A dog."], "--plot-attention needs --engine torch"),
    (["--no-cache", "A dog."], "--no-cache needs --engine torch"),
    (["--engine", "torch", "A dog."], "holds no PyTorch weights"),
    (["--buffer-size", "0"], "--buffer-size must be >= 1"),
])
def test_cli_engine_errors_are_one_line(exported, capsys, monkeypatch, args, message):
    status, out, err = run_main(capsys, monkeypatch, "--checkpoint", exported, *args)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_cli_run_with_engine_ctranslate2_says_to_export(tiny_run, capsys, monkeypatch):
    status, _, err = run_main(capsys, monkeypatch, "--checkpoint", tiny_run, "--engine", "ctranslate2", "A dog.")
    assert status == 2 and err.count("\n") == 1 and "export it first: python export.py" in err, err


# ---------------------------------------------------------------- standard input in chunks


def test_stdin_is_translated_in_chunks_in_input_order(tiny_run, input_file, tmp_path, capsys, monkeypatch):
    """10+ lines with --buffer-size 4: one Translator call per 4 lines, warnings numbered across chunks, and
    the same output as --input."""
    calls = []
    real = Translator.translate

    def counted(self, texts, **kwargs):
        calls.append((len(texts), kwargs.get("first_line")))
        return real(self, texts, **kwargs)

    status, expected, err = run_main(capsys, monkeypatch, "--checkpoint", tiny_run, "--input", input_file)
    assert status == 0, err
    monkeypatch.setattr(Translator, "translate", counted)
    data = input_file.read_bytes() + " ".join(["dog"] * 200).encode() + b"\n"  # 200 words > max_positions 128
    status, out, err = run_main(capsys, monkeypatch, "--checkpoint", tiny_run, "--buffer-size", "4", stdin=data)
    assert status == 0, err
    assert out.split("\n")[:-2] == expected.split("\n")[:-1] and len(out.split("\n")) == len(LINES) + 2
    n = len(LINES) + 1
    assert calls == [(min(4, n - i), i + 1) for i in range(0, n, 4)]
    assert f"warning: input line {n} has" in err


def test_stdin_bad_line_answers_the_lines_before_it(tiny_run, capsys, monkeypatch):
    status, out, err = run_main(capsys, monkeypatch, "--checkpoint", tiny_run, "--beam", "1",
                                stdin=b"A dog.\n\nTwo men.\nUn \xe9t\xe9\nA cat.\n")
    assert status == 2 and err.strip().splitlines()[-1] == "error: standard input is not UTF-8 text (line 4)"
    assert len(out.split("\n")) == 4 and out.split("\n")[1] == ""


@pytest.mark.parametrize("buffer_size", ["3", "1000"])
def test_piped_stdin_equals_input_file(tiny_run, input_file, buffer_size):
    """The script reading a real pipe (select, chunks) against the same script reading --input."""
    command = [sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(tiny_run), "--buffer-size",
               buffer_size]
    piped = subprocess.run(command, input=input_file.read_bytes(), capture_output=True, timeout=300, env=CLI_ENV)
    assert piped.returncode == 0, piped.stderr.decode()
    if buffer_size == "3":
        from_file = subprocess.run([*command, "--input", str(input_file)], capture_output=True, timeout=300,
                                   env=CLI_ENV)
        assert from_file.returncode == 0 and piped.stdout == from_file.stdout
    assert piped.stdout.decode("utf-8").count("\n") == len(LINES)


def read_line(stream, timeout: float = 120) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, "no answer while standard input is still open: the terminal is not answered line by line"
    return stream.readline()


def test_terminal_stdin_is_answered_line_by_line(tiny_run):
    """stdin a pseudo-terminal: each line is answered before the next is typed, after a prompt on stderr."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(tiny_run),
                             "--beam", "1"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=CLI_ENV)
    os.close(slave)
    try:
        answers = []
        for line in SOURCES[:2]:
            os.write(master, line.encode() + b"\n")
            answers.append(read_line(proc.stdout).decode("utf-8").rstrip("\n"))
        os.write(master, b"\x04")  # Ctrl-D: end of input
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        os.close(master)
    assert proc.returncode == 0, err.decode()
    assert err.decode().count("> ") >= 3  # a prompt before each line and before the end
    expected = [t.text for t in Translator.load(tiny_run, device="cpu").translate(SOURCES[:2], beam=1)]
    assert answers == expected


# ---------------------------------------------------------------- decode precision


def test_report_bleu_equals_translate_with_defaults(tiny_run, tmp_path, capsys, monkeypatch):
    """The training report's test BLEU is what translate.py --reference gives with its default settings."""
    results = json.loads((tiny_run / "results.json").read_text("utf-8"))
    assert results["decode_precision"] == "fp32"
    for split in ("val", "test"):
        out = tmp_path / f"{split}.de"
        status, stdout, err = run_main(capsys, monkeypatch, "--checkpoint", tiny_run, "--reference", split,
                                       "--json", "--output", out)
        assert status == 0, err
        assert json.loads(stdout)["bleu"] == results["tests"][split]["bleu"]
        assert out.read_text("utf-8") == (tiny_run / "hyps" / f"{split}.de").read_text("utf-8")


def test_bleu_on_decodes_in_decode_precision_not_training_precision(monkeypatch, tmp_path):
    seen = []

    def fake_translate(model, tokenizer, sources, **options):
        seen.append(options["precision"])
        return sources

    monkeypatch.setattr(evaluation, "translate_texts", fake_translate)
    monkeypatch.setattr(evaluation.dp, "read_raw", lambda prepared, split, lang: ["a b c"])
    for decode_precision in ("fp32", "bf16"):
        cfg = config_from_dict({"train": {"precision": "bf16"}, "decode": {"precision": decode_precision}})
        evaluation.bleu_on(None, None, tmp_path, "val", cfg, evaluation.torch.device("cpu"), beam=1)
    assert seen == ["fp32", "bf16"]
    assert config_from_dict({}).decode.precision == "fp32"
    with pytest.raises(UserError, match="decode.precision 'fp16' is unknown"):
        validate(config_from_dict({"decode": {"precision": "fp16"}}))


def test_translator_precision_defaults_to_the_runs_decode_precision(tiny_run):
    t = Translator.load(tiny_run, device="cpu")
    assert t.cfg.decode.precision == "fp32" and t.precision == "fp32"
    assert Translator.load(tiny_run, device="cpu", precision="bf16").precision == "bf16"
