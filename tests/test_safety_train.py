"""Nothing lost, nothing mixed up (training side): a saved config cannot delete its own run, one live process owns
a run dir, --average never replaces a training checkpoint, every split is checked before training and a finished
run's report can be written again, values that would crash after training fail before it, a full disk is one
line, and the advice after a run that died early is not circular.

Tests that could lose data run the real script in a subprocess; the rest run main() in this process.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXTURES, ROOT
from test_robustness import ENV, MAX_STEPS, RUN_OVERRIDES, assert_user_error, run_main, script, snapshot, train_args

import checkpoint
import train_transformer as tt
from runtime import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run dir, prepared dir) of a tiny run trained once by the real script, started with --overwrite (allowed
    on a new folder) so that the tests can check the flag was not saved."""
    root = tmp_path_factory.mktemp("safety")
    status, out, err = script("train_transformer.py", *train_args(root / "run", root / "prepared", "--overwrite"),
                              timeout=300)
    assert status == 0, err[-3000:]
    return root / "run", root / "prepared"


def checkpoints(run: Path) -> dict:
    return snapshot(*sorted(run.glob("checkpoint_*.pt")))


# ---------------------------------------------------------------- 1. run control is not part of the saved config


def test_saved_config_holds_no_run_control(trained):
    saved = yaml.safe_load((trained[0] / "config.yaml").read_text("utf-8"))
    assert "overwrite" not in saved["train"] and "resume" not in saved["train"], saved["train"]
    for path in trained[0].glob("checkpoint_*.pt"):
        train = torch.load(path, weights_only=True)["config"]["train"]
        assert "overwrite" not in train and "resume" not in train, path.name


def test_running_the_saved_config_again_does_not_delete_the_run(trained, run_copy):
    """The saved config names the run's own out_dir: run as is, it must refuse, not replace the finished run."""
    config = run_copy / "config.yaml"
    saved = yaml.safe_load(config.read_text("utf-8"))
    saved["train"]["out_dir"] = str(run_copy)  # the copy, as the original names the module's run
    config.write_text(yaml.safe_dump(saved), encoding="utf-8")
    before = snapshot(run_copy)
    status, out, err = script("train_transformer.py", "--config", config)
    assert_user_error(status, err, "already holds a run")
    assert snapshot(run_copy) == before


def test_run_control_in_a_config_file_is_ignored_with_a_warning(trained, run_copy, tmp_path, capsys, monkeypatch):
    """A config from before this change says overwrite: true; it must not replace the run either."""
    saved = yaml.safe_load((run_copy / "config.yaml").read_text("utf-8"))
    saved["train"].update(out_dir=str(run_copy), overwrite=True)
    config = tmp_path / "old_style.yaml"
    config.write_text(yaml.safe_dump(saved), encoding="utf-8")
    before = snapshot(run_copy)
    status, out, err = run_main(tt.main, ["--config", config], capsys, monkeypatch)
    assert_user_error(status, err, "already holds a run", strict=False)
    assert "warning: train.overwrite: true in" in err and "is ignored" in err and "--overwrite" in err
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("argv, resume, overwrite", [
    ([], False, False),
    (["--resume"], True, False),
    (["--overwrite"], False, True),
    (["train.resume=true"], True, False),  # the command-line override still works, for old scripts
    (["train.overwrite=true"], False, True),
])
def test_run_control_comes_from_the_command_line_only(argv, resume, overwrite, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  resume: true\n  overwrite: true\n", encoding="utf-8")
    args = tt.parse_args(["--config", str(config), *argv])
    cfg = tt.load_config(args.config, args.overrides)
    assert (cfg.train.resume, cfg.train.overwrite) == (resume, overwrite)


# ---------------------------------------------------------------- 2. one live process per run dir


def wait_for(condition, proc, what: str, timeout: float = 120):
    end = time.time() + timeout
    while time.time() < end:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the first trainer ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_run_dir_belongs_to_one_live_process(trained, run_copy, tmp_path):
    """A long resumed run holds the lock; a second trainer with --overwrite is refused naming its PID and
    touches nothing; after a SIGKILL of the first (no cleanup ran) a third one resumes."""
    lock = run_copy / ".lock"
    log = tmp_path / "first.txt"
    with open(log, "w") as err_file:
        first = subprocess.Popen([sys.executable, str(ROOT / "train_transformer.py"), *train_args(
            run_copy, trained[1], "--resume", "train.max_steps=10000000", "train.eval_every=10000000")],
            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        def owned():  # the copied .lock holds the PID of the run that made it; wait for the new owner's
            return lock.exists() and lock.read_text().strip() == str(first.pid)
        wait_for(owned, first, "the lock")
        wait_for(lambda: "resumed from step" in log.read_text(), first, "the resume")
        before = checkpoints(run_copy)
        assert before
        status, out, err = script("train_transformer.py", *train_args(run_copy, trained[1], "--overwrite"))
        assert_user_error(status, err, f"PID {first.pid}")
        assert "in use by another process" in err
        assert checkpoints(run_copy) == before and first.poll() is None
    finally:
        first.kill()  # SIGKILL: the kernel drops the flock; the .lock file stays behind
        first.wait(timeout=60)
    assert lock.exists()
    status, out, err = script("train_transformer.py", *train_args(
        run_copy, trained[1], "--resume", f"train.max_steps={MAX_STEPS + 2}", "train.eval_every=1000"))
    assert status == 0, err[-3000:]
    assert f"resumed from step {MAX_STEPS} " in err
    assert checkpoint.read_checkpoint(run_copy / "checkpoint_last.pt")["step"] == MAX_STEPS + 2


def test_the_lock_is_taken_before_anything_is_deleted(trained, run_copy):
    """The same check in one process: hold the lock from a child, --overwrite must not delete a file."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import rundir; "
        "rundir.lock_run_dir(Path(sys.argv[2])); print('locked', flush=True); time.sleep(600)"),
        str(ROOT), str(run_copy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run_copy)
        status, out, err = script("train_transformer.py", *train_args(run_copy, trained[1], "--overwrite"))
        assert_user_error(status, err, f"in use by another process (PID {holder.pid}")
        assert snapshot(run_copy) == before
    finally:
        holder.kill()
        holder.wait(timeout=60)


# ---------------------------------------------------------------- 3. --average never replaces a training checkpoint


@pytest.mark.parametrize("output", ["checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_step30.pt",
                                    "elsewhere/checkpoint_step7.pt", "renamed_last.pt", "notes.txt"])
def test_average_never_overwrites_a_training_checkpoint(output, run_copy, tmp_path, capsys, monkeypatch):
    shutil.copy(run_copy / "checkpoint_last.pt", run_copy / "renamed_last.pt")  # optimizer state, another name
    (run_copy / "notes.txt").write_text("my notes\n", encoding="utf-8")
    (tmp_path / "elsewhere").mkdir()
    target = (tmp_path / output) if output.startswith("elsewhere") else run_copy / output
    before = snapshot(tmp_path)
    status, out, err = run_main(tt.main, ["--average", run_copy, "--output", target], capsys, monkeypatch)
    assert_user_error(status, err, "--output")
    assert snapshot(tmp_path) == before


def test_average_still_writes_its_own_file(run_copy, capsys, monkeypatch):
    for _ in range(2):  # the second time over its own earlier output
        status, out, err = run_main(tt.main, ["--average", run_copy, "--last", "2"], capsys, monkeypatch)
        assert status == 0, err
    assert "optimizer" not in checkpoint.read_checkpoint(run_copy / "checkpoint_avg.pt")


# ---------------------------------------------------------------- 4. every split before training; the report again


def test_an_empty_test_split_is_refused_before_training(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for lang in ("en", "de"):
        (corpus / f"news.{lang}").write_text("", encoding="utf-8")
    run = tmp_path / "run"
    args = train_args(run, tmp_path / "prepared", f"data.test_prefixes=[{FIXTURES / 'test'}, {corpus / 'news'}]")
    status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, "the test split 'news' is empty")
    assert "train:" not in err  # no progress bar: refused before the first step
    assert not list(run.glob("checkpoint_*"))


def test_report_writes_a_finished_runs_report_again(run_copy, capsys, monkeypatch):
    expected = (run_copy / "results.json").read_text("utf-8")
    for name in ("results.json", "curves.png"):
        (run_copy / name).unlink()
    shutil.rmtree(run_copy / "hyps")
    before = snapshot(run_copy / "checkpoint_last.pt", run_copy / "checkpoint_best.pt")
    status, out, err = run_main(tt.main, ["--report", run_copy], capsys, monkeypatch)
    assert status == 0, err
    assert "sacreBLEU signature" in out and "train:" not in err
    results = yaml.safe_load((run_copy / "results.json").read_text("utf-8"))
    old = yaml.safe_load(expected)
    assert results["step"] == MAX_STEPS and results["tests"].keys() == old["tests"].keys()
    assert results["tests"]["test"]["bleu"] == old["tests"]["test"]["bleu"]
    assert (run_copy / "hyps" / "test.de").exists() and (run_copy / "curves.png").exists()
    assert snapshot(run_copy / "checkpoint_last.pt", run_copy / "checkpoint_best.pt") == before


def test_report_on_a_folder_that_is_no_run(tmp_path, capsys, monkeypatch):
    status, out, err = run_main(tt.main, ["--report", tmp_path], capsys, monkeypatch)
    assert_user_error(status, err, "no config.yaml")


def test_resume_of_a_finished_run_goes_straight_to_the_report(trained, run_copy):
    (run_copy / "results.json").unlink()
    last = run_copy / "checkpoint_last.pt"
    mtime, before = last.stat().st_mtime_ns, checkpoints(run_copy)
    status, out, err = script("train_transformer.py", *train_args(run_copy, trained[1], "--resume"))
    assert status == 0, err[-3000:]
    assert (run_copy / "results.json").exists() and "sacreBLEU signature" in out
    assert "resumed from step" not in err  # no trainer was built, no checkpoint rewritten
    assert last.stat().st_mtime_ns == mtime and checkpoints(run_copy) == before


# ---------------------------------------------------------------- 5. values that would crash after training


def test_beam_larger_than_the_vocabulary_allows_fails_before_training(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    status, out, err = run_main(tt.main, train_args(run, tmp_path / "prepared", "decode.beam=300"), capsys,
                                monkeypatch)
    assert_user_error(status, err, "decode.beam=300 is too large for the target vocabulary", strict=False)
    assert "train:" not in err and not list(run.glob("checkpoint_*"))


@pytest.mark.parametrize("device", ["mps", "meta", "cuda:99", "cpu:0", "cuda:-1", "CPU"])
def test_unusable_train_device_is_one_line_before_any_work(device, tmp_path, capsys, monkeypatch):
    run, prepared = tmp_path / "run", tmp_path / "prepared"
    status, out, err = run_main(tt.main, train_args(run, prepared, f"train.device={device}"), capsys, monkeypatch)
    assert_user_error(status, err, "train.device")
    assert not run.exists() and not prepared.exists()


def test_checkpoint_of_a_model_too_large_for_memory_is_refused_before_allocating():
    """65536 x 10^6 embedding alone is 256 TiB: building it would die in the allocator or wake the OOM killer."""
    model = {"d_model": 65536, "n_heads": 8, "d_ff": 10**6, "src_vocab_size": 10**6, "tgt_vocab_size": 10**6}
    with pytest.raises(UserError, match=r"fake\.pt holds an unusable config: its model needs at least .* GiB"):
        checkpoint.load_model({"model": {}, "config": {"model": model}}, Path("fake.pt"))


# ---------------------------------------------------------------- 6. a full disk inside torch's zip writer


def test_full_disk_in_the_zip_writer_is_one_line_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_last.pt"
    checkpoint.save_checkpoint({"model": {"w": torch.ones(3)}, "step": 1}, path)
    before = snapshot(tmp_path)

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"PK half a zip")
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match=r"could not write .*checkpoint_last\.pt: .*file write failed.*disk may be "
                                        r"full.*previous checkpoint is intact") as e:
        checkpoint.save_checkpoint({"model": {"w": torch.zeros(3)}, "step": 2}, path)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    assert checkpoint.read_checkpoint(path)["step"] == 1


# ---------------------------------------------------------------- 7. a run that died before its first checkpoint


@pytest.fixture
def died_early(run_copy):
    """What a run killed during its first steps leaves: config.yaml, tokenizer/, .lock, no checkpoint."""
    for p in [*run_copy.glob("checkpoint_*.pt"), run_copy / "metrics.jsonl", run_copy / "results.json"]:
        p.unlink()
    return run_copy


@pytest.mark.parametrize("flag, words", [
    ([], ["already holds a run", "nothing to resume", "--overwrite"]),
    (["--resume"], ["does not exist", "nothing to resume", "--overwrite"]),
])
def test_advice_after_a_run_that_died_before_its_first_checkpoint(flag, words, died_early, trained, capsys,
                                                                  monkeypatch):
    before = snapshot(died_early)
    status, out, err = run_main(tt.main, train_args(died_early, trained[1], *flag), capsys, monkeypatch)
    for word in words:
        assert_user_error(status, err, word)
    assert "(--resume)" not in err  # the advice that led back to where it started
    assert snapshot(died_early) == before
    status, out, err = run_main(tt.main, train_args(died_early, trained[1], "--overwrite", "train.max_steps=2",
                                                    "train.eval_every=2"), capsys, monkeypatch)
    assert status == 0, err  # and the advice works


def test_resume_on_a_folder_without_a_run_says_to_start_without_it(tmp_path, trained, capsys, monkeypatch):
    status, out, err = run_main(tt.main, train_args(tmp_path / "new", trained[1], "--resume"), capsys, monkeypatch)
    assert_user_error(status, err, "no run to resume")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- probes that gave a silently wrong result


@pytest.mark.parametrize("override, message", [
    ("train.out_dir=", "train.out_dir is empty"),  # was: a whole run written into the current folder
    ("train.eval_bleu_sentences=-3", "train.eval_bleu_sentences must be >= 0"),  # was: all but the last 3 scored
])
def test_values_that_trained_into_the_wrong_place_or_scored_the_wrong_sentences(override, message, tmp_path,
                                                                               capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = [f"data.train_prefix={FIXTURES / 'train'}", f"data.valid_prefix={FIXTURES / 'val'}",
            f"data.test_prefixes=[{FIXTURES / 'test'}]"]  # absolute: the run starts in an empty folder
    status, out, err = run_main(tt.main, ["--config", ROOT / "configs/tiny.yaml", *data, "data.prepared_dir=prepared",
                                          *RUN_OVERRIDES[1:], override], capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert not list(tmp_path.iterdir())


def test_overrides_may_follow_a_flag():
    """`--resume train.max_steps=50` was an argparse error ('unrecognized arguments')."""
    args = tt.parse_args(["--config", "c.yaml", "train.seed=2", "--resume", "train.max_steps=50"])
    assert args.resume and {"train.seed=2", "train.max_steps=50", "train.resume=true"} <= set(args.overrides)


def test_average_says_when_the_run_kept_fewer_checkpoints_than_asked(run_copy, capsys, monkeypatch):
    status, out, err = run_main(tt.main, ["--average", run_copy, "--last", "5"], capsys, monkeypatch)
    assert status == 0 and "has only 2 step checkpoint(s); averaging 2, not --last 5" in err, err
