"""Nothing lost, nothing mixed up (translation side): --output onto FIFOs, devices and symlinks, outputs that are
inputs, a full disk, SIGTERM mid-write, a BOM, exactly N n-best lines, non-finite numbers, and bad arguments
that used to crash or translate before failing. Data-loss cases run the real script in a subprocess."""

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT
from test_translate import CLI_ENV, EOS, StubModel, cli, run_dir, run_main, stub_src  # noqa: F401 - run_dir

import decoding
import runtime
import translate as tr

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["A dog runs.", "Two men play football in the park.", "A girl."]


def temp_files(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def expected_text(run_dir, *args):  # noqa: F811 - the fixture's value
    proc = cli("--checkpoint", run_dir, *args, *SENTENCES)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode("utf-8")


@pytest.fixture
def run_copy(run_dir, tmp_path):  # noqa: F811
    """A copy of the run, for tests that might (on a regression) write over its files."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    return run


# ---------------------------------------------------------------- 1. --output onto a FIFO, a device, a symlink


def test_output_to_a_fifo_is_written_in_place(run_dir, tmp_path):  # noqa: F811
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    proc = cli("--checkpoint", run_dir, "--output", fifo, *SENTENCES)
    reader.join(timeout=30)  # before the fix the FIFO was replaced by a file: its reader waited forever
    assert proc.returncode == 0, proc.stderr.decode()
    assert stat.S_ISFIFO(fifo.stat().st_mode), "the FIFO was replaced by a regular file"
    assert got and got[0].decode("utf-8") == expected_text(run_dir)
    assert temp_files(tmp_path) == []


def test_output_to_a_symlink_writes_its_target(run_dir, tmp_path):  # noqa: F811
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.de"
    target.write_text("old\n", encoding="utf-8")
    link = tmp_path / "out.de"
    link.symlink_to(target)
    proc = cli("--checkpoint", run_dir, "--output", link, *SENTENCES)
    assert proc.returncode == 0, proc.stderr.decode()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text("utf-8") == expected_text(run_dir)
    assert temp_files(tmp_path) == temp_files(tmp_path / "real") == []


def test_output_to_a_character_device_keeps_the_device(run_dir, tmp_path):  # noqa: F811
    node = tmp_path / "null"  # our own null device: the real /dev/null is never touched
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a device node here: {e}")
    proc = cli("--checkpoint", run_dir, "--output", node, *SENTENCES)
    assert proc.returncode == 0, proc.stderr.decode()
    assert stat.S_ISCHR(node.stat().st_mode), "the device node was replaced by a regular file"
    assert node.read_bytes() == b"" and temp_files(tmp_path) == []


# ---------------------------------------------------------------- 2. an output that is an input


def output_onto(case, run, tmp_path):
    """(arguments, the file that must survive) for an --output that is one of the command's inputs."""
    src = tmp_path / "in.en"
    src.write_text("A dog runs.\nTwo men.\n", encoding="utf-8")
    ref = tmp_path / "ref.de"
    ref.write_text("Ein Hund rennt.\nZwei Männer.\n", encoding="utf-8")
    ckpt = run / "checkpoint_last.pt"
    if case == "reference":
        return ["--input", src, "--reference", ref, "--output", ref], ref, "--reference"
    if case == "reference_hard_link":
        os.link(ref, tmp_path / "ref_link.de")
        return ["--input", src, "--reference", ref, "--output", tmp_path / "ref_link.de"], ref, "--reference"
    if case == "input_hard_link":
        os.link(src, tmp_path / "in_link.en")
        return ["--input", src, "--output", tmp_path / "in_link.en"], src, "--input"
    if case == "input_symlink":
        (tmp_path / "in_sym.en").symlink_to(src)
        return ["--input", src, "--output", tmp_path / "in_sym.en"], src, "--input"
    if case == "checkpoint_link":
        os.link(ckpt, tmp_path / "weights.bin")
        return ["--output", tmp_path / "weights.bin", "A dog."], ckpt, "--checkpoint"
    if case == "tokenizer":
        return ["--output", run / "tokenizer" / "spm.model", "A dog."], run / "tokenizer" / "spm.model", "tokenizer"
    if case == "config":
        return ["--output", run / "config.yaml", "A dog."], run / "config.yaml", "config.yaml"
    if case == "plot_is_reference":
        return ["--reference", ref, "--plot-attention", ref, "A dog."], ref, "--reference"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["reference", "reference_hard_link", "input_hard_link", "input_symlink",
                                  "checkpoint_link", "tokenizer", "config", "plot_is_reference"])
def test_output_that_is_an_input_is_refused_before_any_work(case, run_copy, tmp_path):
    args, keep, flag = output_onto(case, run_copy, tmp_path)
    before = keep.read_bytes()
    proc = cli("--checkpoint", run_copy, *args)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"", err
    assert err.startswith("error: ") and err.count("\n") == 1 and flag in err and "Traceback" not in err, err
    assert keep.read_bytes() == before


# ---------------------------------------------------------------- 3. a full disk, a signal mid-write


def failing_write(monkeypatch, fault):
    """translate.py's atomic_write, with the temp file's write (or the final rename) failing like the machine."""
    real = runtime.atomic_write

    @contextlib.contextmanager
    def atomic_write(path, *args, **kwargs):
        with real(path, *args, **kwargs) as f:
            if fault == "disk_full":
                def write(text):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                f.write = write
            yield f

    monkeypatch.setattr(tr, "atomic_write", atomic_write)
    if fault == "other_disk":  # the rename fails as if the temp file were on another file system
        def replace(src, dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), str(dst))
        monkeypatch.setattr(runtime.os, "replace", replace)


@pytest.mark.parametrize("fault, words", [("disk_full", "the disk is full"),
                                          ("other_disk", "Invalid cross-device link")])
def test_failed_write_names_the_output_and_leaves_no_temp_file(fault, words, run_dir, tmp_path, capsys,  # noqa: F811
                                                               monkeypatch):
    out = tmp_path / "out.de"
    out.write_text("previous\n", encoding="utf-8")
    failing_write(monkeypatch, fault)
    status, stdout, err = run_main(capsys, "--checkpoint", run_dir, "--output", out, *SENTENCES)
    assert status == 2 and err.count("\n") == 1, err
    assert f"--output {out}: " in err and words in err and ".tmp" not in err, err
    assert temp_files(tmp_path) == [] and out.read_text("utf-8") == "previous\n"


def test_unwritable_output_folder_names_the_output(run_dir, capsys):  # noqa: F811
    out = "/proc/h14t_translations.de"  # a folder nobody may create files in, even root
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    status, _, err = run_main(capsys, "--checkpoint", run_dir, "--output", out, "A dog.")
    assert status == 2 and err.count("\n") == 1 and f"--output {out}: " in err and ".tmp" not in err, err


def default_sigint() -> None:
    """Ctrl-C's default action in the child, as in a terminal: a suite started in the background (`cmd &` in a
    script) runs with SIGINT ignored, which the child would inherit, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_output_leaves_no_temp_file(sig, code, run_dir, tmp_path):  # noqa: F811
    out = tmp_path / "out.de"
    out.write_text("previous\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(run_dir),
                             "--output", str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=CLI_ENV, preexec_fn=default_sigint)
    try:
        proc.stdin.write(b"A dog runs.\n")  # stdin stays open: the command waits inside atomic_write
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while not temp_files(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert temp_files(tmp_path), "the temp file never appeared"
        time.sleep(0.5)  # let it translate the line and block on the next read
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert temp_files(tmp_path) == [] and out.read_text("utf-8") == "previous\n"


# ---------------------------------------------------------------- 4. a byte order mark


def test_bom_in_input_file_is_ignored(run_dir, tmp_path, capsys):  # noqa: F811
    plain, bom = tmp_path / "plain.en", tmp_path / "bom.en"
    plain.write_bytes(b"A dog runs.\nTwo men.\n")
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    results = [run_main(capsys, "--checkpoint", run_dir, "--nbest", "2", "--input", f) for f in (plain, bom)]
    assert results[0][0] == 0 and results[0][:2] == results[1][:2]  # status and stdout (stderr: a progress bar)


def test_bom_on_stdin_is_ignored(run_dir):  # noqa: F811
    plain = cli("--checkpoint", run_dir, "--nbest", "2", stdin=b"A dog runs.\nTwo men.\n")
    bom = cli("--checkpoint", run_dir, "--nbest", "2", stdin=b"\xef\xbb\xbfA dog runs.\nTwo men.\n")
    assert plain.returncode == bom.returncode == 0, bom.stderr.decode()
    assert bom.stdout == plain.stdout


def test_bom_in_reference_file_is_ignored(run_dir, tmp_path, capsys):  # noqa: F811
    hyps = tmp_path / "hyps.de"
    assert run_main(capsys, "--checkpoint", run_dir, "--output", hyps, *SENTENCES)[0] == 0
    bom = tmp_path / "bom.de"
    bom.write_bytes(b"\xef\xbb\xbf" + hyps.read_bytes())  # the output as its own reference: chrF 100
    scores = []
    for ref in (hyps, bom):
        status, out, err = run_main(capsys, "--checkpoint", run_dir, "--reference", ref, "--json", "--output",
                                    tmp_path / "again.de", *SENTENCES)
        assert status == 0, err
        scores.append(json.loads(out))
    assert scores[0]["chrf"] == pytest.approx(100.0) and scores[1] == scores[0]


# ---------------------------------------------------------------- 5. exactly N n-best lines


@pytest.mark.parametrize("beam, nbest, lengths", [
    (2, 2, []), (3, 3, ["--max-len-a", "0", "--max-len-b", "1"]), (5, 4, ["--max-len-a", "0.5", "--max-len-b", "1"]),
    (250, 250, ["--max-len-a", "0", "--max-len-b", "1"]),  # beam x 2 > the 400-piece vocabulary
])
def test_nbest_gives_exactly_n_lines_per_input(beam, nbest, lengths, run_dir, capsys):  # noqa: F811
    status, out, err = run_main(capsys, "--checkpoint", run_dir, "--beam", beam, "--nbest", nbest, *lengths,
                                *SENTENCES)
    assert status == 0, err
    rows = [line.split("\t") for line in out.split("\n")[:-1]]
    assert [int(r[0]) for r in rows] == [i for i in range(len(SENTENCES)) for _ in range(nbest)]
    assert all(len(r) == 3 for r in rows)
    for i in range(len(SENTENCES)):
        scores = [float(r[1]) for r in rows if int(r[0]) == i]
        assert scores == sorted(scores, reverse=True)


def test_beam_wider_than_the_vocabulary_fills_the_nbest_list():
    """Vocabulary eos, A, B: within one token only "", "A", "B" exist; a 4-best list gets one filler entry.
    Before: topk(2 * beam) over 6 ids raised, and a smaller beam gave 3 lines for 4."""
    model = StubModel({}, default={EOS: 0.2, 4: 0.5, 5: 0.3})
    (hyps,) = decoding.beam_search(model, stub_src([7, EOS]), beam=4, len_penalty=0.0, max_len_a=0.0,
                                   max_len_b=1, nbest=4)
    assert [t for t, _ in hyps] == [[], [4], [5], []]
    assert [s for _, s in hyps][:3] == pytest.approx([math.log(0.2), math.log(0.5 * 0.2), math.log(0.3 * 0.2)])
    assert hyps[3][1] == -math.inf


def test_max_len_b_zero_is_refused(run_dir, capsys):  # noqa: F811
    """A bound of 0 tokens allows only the empty translation: one n-best line instead of N, empty output."""
    status, out, err = run_main(capsys, "--checkpoint", run_dir, "--max-len-a", "0", "--max-len-b", "0", "A dog.")
    assert status == 2 and out == "" and "--max-len-b must be >= 1" in err, err


# ---------------------------------------------------------------- 6. non-finite numbers


@pytest.mark.parametrize("flag, value", [("--max-len-a", "inf"), ("--max-len-a", "nan"), ("--len-penalty", "nan"),
                                         ("--len-penalty=-inf", None), ("--max-len-a", "1e999")])
def test_non_finite_numbers_are_refused(flag, value, run_dir, capsys):  # noqa: F811
    status, out, err = run_main(capsys, "--checkpoint", run_dir, *([flag] if value is None else [flag, value]),
                                "A dog.")
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert f"{flag.split('=')[0]} must be a finite number" in err, err


def test_huge_length_factor_is_capped_not_wrapped():
    """1e300 * length cast to int64 wrapped around to a negative number, clamped to 0: empty translations."""
    model = decoding_model()
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert decoding.max_lengths(model, mask, 1e300, 1).tolist() == [model.cfg.max_positions - 1] * 2
    assert decoding.max_lengths(model, mask, 1.0, 10**30).tolist() == [model.cfg.max_positions - 1] * 2
    assert decoding.max_lengths(model, mask, 0.5, 1).tolist() == [3, 3]


def decoding_model():
    from test_translate import tiny_model

    return tiny_model()


# ---------------------------------------------------------------- probes: bad arguments, one line before any work


@pytest.mark.parametrize("args, message", [
    (["--plot-attention", "attn.xyz", "A dog."], "matplotlib cannot write '.xyz' images"),
    (["--threads", "100000", "A dog."], "--threads must be between 1 and"),
    (["--output", "", "A dog."], "--output is empty"),
    (["--reference", "REF", "A dog.", "Two men."], "--reference has 1 reference lines but there are 2 sentences"),
    (["--layer", "0", "--plot-attention", "a.png", "A dog."], "--layer 0 is out of range"),
    (["--head", "9", "--plot-attention", "a.png", "A dog."], "--head 9 is out of range"),
])
def test_bad_arguments_fail_before_translating(args, message, run_dir, tmp_path):  # noqa: F811
    ref = tmp_path / "ref.de"
    ref.write_text("Ein Hund.\n", encoding="utf-8")
    proc = cli("--checkpoint", run_dir, *[ref if a == "REF" else a for a in args])
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"", err  # nothing translated first
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_output_through_a_link_to_a_pipe_writes_the_pipe(run_dir, tmp_path):  # noqa: F811
    """A link like /dev/stdout -> /proc/self/fd/1 -> 'pipe:[N]' (its target has no usable name) is written
    through the link (our own link: the real /dev/stdout is never touched). Before: the link was replaced."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs Linux /proc")
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    proc = cli("--checkpoint", run_dir, "--output", link, *SENTENCES)  # the child's stdout is a pipe
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == expected_text(run_dir)
    assert link.is_symlink() and temp_files(tmp_path) == []
