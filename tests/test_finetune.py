"""Fine-tuning (train.init_from): a new run from a trained run's weights, encoding its data with that run's
tokenizer, under a fresh optimizer and lr schedule; refused in one line, before any work, when the model or the
vocabulary differs or when --resume is given too; and a fine-tuned run resumes from its own state.

The source is a copy of the session's tiny_run (configs/tiny.yaml on the fixture corpus); the new data is a
shifted corpus: other training pairs (part of the fixture's training split, reversed, plus its test split) and
the validation sentences in another order. Training runs the real script in a subprocess; errors run main()."""

import json
import shutil

import pytest
from conftest import fixture_config, fixture_lines, write_corpus
from test_robustness import assert_user_error, run_main, script, snapshot

import data_preparation as dp
import train_transformer as tt
from checkpoint import read_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# Both the fine-tuned and the fresh run: a low lr (as fine-tuning uses), first evaluation after 2 updates.
STEPS = ["train.warmup=10", "train.lr_factor=0.1", "train.eval_every=2", "train.average_last=0",
         "model.dropout=0.2", "decode.max_len_a=0", "decode.max_len_b=6"]  # dropout: a field that may change


def tokenizer_files(folder) -> dict:
    """{file name: bytes} of a saved tokenizer folder."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def val_losses(run) -> list[float]:
    return [json.loads(line)["val_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shifted(tmp_path_factory, tiny_run):
    """(root, source run, data overrides for the shifted corpus)."""
    root = tmp_path_factory.mktemp("finetune")
    source = root / "source"
    shutil.copytree(tiny_run, source)
    corpus = root / "corpus"
    train = {lang: fixture_lines("train", lang)[::-1][:30] + fixture_lines("test", lang) for lang in ("en", "de")}
    write_corpus(corpus, "train", train["en"], train["de"])
    write_corpus(corpus, "val", fixture_lines("val", "en")[::-1], fixture_lines("val", "de")[::-1])
    data = [f"data.train_prefix={corpus / 'train'}", f"data.valid_prefix={corpus / 'val'}", "data.test_prefixes=[]",
            f"data.prepared_dir={root / 'prepared'}"]
    return root, source, data


def train(run, data, *extra):
    status, out, err = script("train_transformer.py", "--config", "configs/tiny.yaml", f"train.out_dir={run}",
                              *data, *STEPS, *extra, timeout=300)
    assert status == 0, err[-3000:]
    return err


@pytest.fixture(scope="module")
def finetuned(shifted):
    """The run fine-tuned for 4 updates from the source on the shifted corpus."""
    root, source, data = shifted
    train(root / "finetuned", data, f"train.init_from={source}", "train.max_steps=4")
    return root / "finetuned"


# ---------------------------------------------------------------- 1. the source's weights and tokenizer


def test_finetuned_run_starts_from_the_source_model(shifted, finetuned):
    root, source, data = shifted
    fresh = root / "fresh"
    train(fresh, data, "train.max_steps=2")
    # the first evaluation: the fine-tuned model is the trained one after 2 small updates, the fresh one is not
    assert val_losses(finetuned)[0] < val_losses(fresh)[0] - 1.0, (val_losses(finetuned), val_losses(fresh))
    # the tokenizer is the source's, byte for byte, in the run and in the data it was encoded into
    assert tokenizer_files(finetuned / "tokenizer") == tokenizer_files(source / "tokenizer")
    prepared = sorted((root / "prepared").iterdir())
    assert len(prepared) == 2, prepared  # the fresh run trained its own tokenizer: another folder, not this one
    used = [p for p in prepared if dp.tokenizer_fingerprint(p) == dp.tokenizer_fingerprint(source / "tokenizer")]
    assert len(used) == 1 and dp.tokenizer_fingerprint(fresh / "tokenizer") != dp.tokenizer_fingerprint(used[0])
    # a new run: step count, optimizer and lr schedule (its own warmup and factor) start from zero
    state = read_checkpoint(finetuned / "checkpoint_last.pt")
    assert state["step"] == 4 and float(state["optimizer"]["state"][0]["step"]) == 4
    lrs = [json.loads(line)["lr"] for line in (finetuned / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([tt.learning_rate(s, 32, 10, 0.1) for s in (2, 4)])
    # recorded with the run; the changed dropout is kept
    assert state["config"]["train"]["init_from"] == str(source) and state["config"]["model"]["dropout"] == 0.2


def test_prepared_data_cache_is_keyed_by_the_given_tokenizer(shifted, tmp_path):
    """The same text and data.* settings encoded with a given tokenizer is another folder than with a trained one."""
    _, source, _ = shifted
    cfg = fixture_config(tmp_path, vocab_size=500)
    own = dp.prepare(cfg)
    given = dp.prepare(cfg, tokenizer=source / "tokenizer")
    assert given != own and dp.prepare(cfg) == own and dp.prepare(cfg, tokenizer=source / "tokenizer") == given
    expected = tokenizer_files(source / "tokenizer")
    assert {name: (given / name).read_bytes() for name in expected} == expected


# ---------------------------------------------------------------- 2. mismatches: one line, before any work


@pytest.mark.parametrize("override, field", [
    ("model.d_model=64", "model.d_model is 64 here but 32 in the source"),
    ("model.norm_first=true", "model.norm_first"),
    ("data.vocab_size=600", "data.vocab_size is 600 here but 500 in the source"),
    ("data.src_lang=fr", "data.src_lang"),
    ("data.lowercase=true", "data.lowercase is True here but False in the source"),
])
def test_mismatch_with_the_source_is_one_line_before_data_preparation(shifted, tmp_path, capsys, monkeypatch,
                                                                       override, field):
    _, source, data = shifted
    run, prepared = tmp_path / "run", tmp_path / "prepared"
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={run}", *data, f"data.prepared_dir={prepared}",
            f"train.init_from={source}", override]
    status, out, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, field)
    assert "fine-tuning keeps the source's model and tokenizer" in err
    assert not prepared.exists() and not run.exists() and out == ""


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "missing", "train.init_from: checkpoint not found"),
    (lambda root: root / "garbage.pt", "train.init_from: cannot read checkpoint"),
    (lambda root: root / "empty_dir", "train.init_from: no checkpoint in"),
])
def test_unusable_init_from_is_one_line(shifted, tmp_path, capsys, monkeypatch, make, message):
    _, _, data = shifted
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint\n" * 10)
    (tmp_path / "empty_dir").mkdir()
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={tmp_path / 'run'}", *data,
            f"data.prepared_dir={tmp_path / 'prepared'}", f"train.init_from={make(tmp_path)}"]
    status, _, err = run_main(tt.main, args, capsys, monkeypatch)
    assert_user_error(status, err, message)
    assert not (tmp_path / "prepared").exists()


# ---------------------------------------------------------------- 3. fine-tune or resume, not both


def test_init_from_with_resume_is_refused(shifted, finetuned, capsys, monkeypatch):
    root, source, data = shifted
    before = snapshot(finetuned)
    for flags in (["--resume"], ["train.resume=true"]):
        args = ["--config", "configs/tiny.yaml", f"train.out_dir={finetuned}", *data, f"train.init_from={source}",
                *flags]
        status, _, err = run_main(tt.main, args, capsys, monkeypatch)
        assert_user_error(status, err, "train.init_from and --resume (train.resume=true) are both given")
        assert "starts a NEW run" in err and "--config RUN_DIR/config.yaml --resume" in err
    assert snapshot(finetuned) == before


# ---------------------------------------------------------------- 4. a fine-tuned run resumes


def test_finetuned_run_resumes_from_its_own_state(shifted, finetuned):
    """2 updates, then --resume from its config.yaml to 4: the weights of the uninterrupted 4-update run, after the
    source was deleted (resuming reads neither its weights nor its tokenizer)."""
    root, source, data = shifted
    copy = root / "source_copy"
    shutil.copytree(source, copy)
    run = root / "interrupted"
    train(run, data, f"train.init_from={copy}", "train.max_steps=2")
    shutil.rmtree(copy)
    status, _, err = script("train_transformer.py", "--config", run / "config.yaml", "--resume", "train.max_steps=4",
                            timeout=300)
    assert status == 0, err[-3000:]
    assert "resumed from step 2" in err and "fine-tuning:" not in err
    a = read_checkpoint(finetuned / "checkpoint_last.pt")
    b = read_checkpoint(run / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 4
    for key in a["model"]:
        assert a["model"][key].equal(b["model"][key]), key


def test_translate_reference_reuses_the_finetuned_data(shifted, finetuned):
    """--reference SPLIT of a fine-tuned run finds the data it was trained on: encoded with the inherited
    tokenizer, so no tokenizer is trained and no other prepared folder appears."""
    root = shifted[0]
    before = sorted(p.name for p in (root / "prepared").iterdir())
    status, out, err = script("translate.py", "--checkpoint", finetuned, "--reference", "val", "--beam", "1",
                              "--max-len-b", "6")
    assert status == 0, err[-3000:]
    assert "using prepared data" in err and "training the" not in err
    assert sorted(p.name for p in (root / "prepared").iterdir()) == before


def test_report_of_a_finetuned_run_uses_its_own_tokenizer(finetuned, tmp_path, capsys, monkeypatch):
    """--report RUN_DIR encodes with the run's tokenizer/ (found in the prepared data cache), trains none."""
    run = tmp_path / "run"
    shutil.copytree(finetuned, run)
    status, out, err = run_main(tt.main, ["--report", run], capsys, monkeypatch)
    assert status == 0, err[-3000:]
    assert "using prepared data" in out and "training the" not in out + err
    assert json.loads((run / "results.json").read_text())["tests"].keys() == {"val"}
