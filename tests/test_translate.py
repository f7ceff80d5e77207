"""Tests of translate.py: beam search followed by hand on a stub model, the decoding invariants of a real tiny
Transformer (cache, batching, beam 1 = greedy, length bound), text handling, scores, and the command line."""

import contextlib
import io
import json
import math
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, ROOT, fixture_data, run_in_process
from torch import nn

import checkpoint
import data_preparation as dp
import decoding
import scoring
import translate as tr
from config import DataConfig, config_from_dict, config_to_dict, save_config
from runtime import UserError
from transformer_model import ModelConfig, Transformer

PAD, BOS, EOS, A, B = 0, 2, 3, 4, 5  # stub vocabulary: pad, unk, bos, eos, A, B
# Subprocess environment: one thread (tiny models), and buffered stdout as users get (so flushing is tested).
CLI_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1",
           "NMT_DEBUG": "0"}


pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------- a stub model with hand-set probabilities


class StubCache:
    """Keeps the prefix fed so far; reorder must move it with the beams or the stub answers another prefix."""

    def __init__(self):
        self.prefix = None

    def reorder(self, index):
        self.prefix = self.prefix.index_select(0, index)

    def reorder_beams(self, rows, kept):  # the prefix is per-beam state, like self-attention's K/V
        self.reorder(rows)


class StubModel(nn.Module):
    """Next-token probabilities looked up by (sentence id, prefix); the sentence id is the first source token.

    tables: {sentence id: {prefix tuple: {token: probability}}}; other prefixes use the table's None entry,
    else `default`.
    decode returns the log-probabilities themselves as 'hidden states' and logits() is the identity.
    """

    def __init__(self, tables, default=None, vocab=6):
        super().__init__()
        self.tables, self.default, self.vocab = tables, default or {EOS: 0.5, A: 0.3, B: 0.2}, vocab
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the model a device
        self.calls = 0

    def logits(self, h):
        return h

    def encode(self, src):
        return src.float().unsqueeze(-1), src != PAD  # memory (B,S,1) carries the ids, so rows can be traced

    def new_cache(self):
        return StubCache()

    def log_probs(self, sid, prefix):
        out = torch.full((self.vocab,), -math.inf)
        table = self.tables.get(sid, {})
        for token, p in table.get(prefix, table.get(None, self.default)).items():
            out[token] = math.log(p)
        return out

    def decode(self, tgt, memory, src_mask, cache=None):
        self.calls += 1
        assert self.calls < 200, "the search does not stop"
        assert memory.size(0) == tgt.size(0) == src_mask.size(0)  # the search keeps the three aligned
        full = tgt if cache is None else (tgt if cache.prefix is None else torch.cat([cache.prefix, tgt], 1))
        if cache is not None:
            cache.prefix = full
        rows = []
        for b in range(full.size(0)):
            sid = int(memory[b, 0, 0])
            rows.append(torch.stack([self.log_probs(sid, tuple(full[b, 1:p + 1].tolist()))
                                     for p in range(full.size(1) - tgt.size(1), full.size(1))]))
        return torch.stack(rows)  # (B,t,V)


# Sentence 4: greedy takes A (0.6) then eos (0.4): p(A) = 0.24; beam 2 also keeps B and finds B eos = 0.36.
NOT_GREEDY = {(): {A: 0.6, B: 0.4}, (A,): {EOS: 0.4, A: 0.35, B: 0.25}, (B,): {EOS: 0.9, A: 0.05, B: 0.05}}
# Sentence 5: "A" (p 0.275, 2 tokens with eos) beats "B A" (p 0.243, 3 tokens) unless the length penalty acts.
LENGTHS = {(): {A: 0.55, B: 0.45}, (A,): {EOS: 0.5, A: 0.3, B: 0.2}, (B,): {A: 0.9, B: 0.1},
           (B, A): {EOS: 0.6, A: 0.25, B: 0.15}}
# Sentence 6: eos is never likely enough, so it is forced at the maximum length.
NO_END = {None: {A: 0.6, B: 0.3, EOS: 0.1}}


def stub_src(*rows):
    return decoding.pad_batch([list(r) for r in rows])


def test_stub_best_hypothesis_is_not_the_greedy_one():
    model = StubModel({4: NOT_GREEDY})
    src = stub_src([4, EOS])
    assert decoding.greedy_search(model, src, 1.0, 10) == [[A]]
    (hyps,) = decoding.beam_search(model, src, beam=2, len_penalty=0.0, max_len_a=1.0, max_len_b=10, nbest=2)
    assert [h[0] for h in hyps] == [[B], [A]]  # distinct: only beam 0 is expanded at the first step
    assert hyps[0][1] == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)
    assert hyps[1][1] == pytest.approx(math.log(0.6 * 0.4), abs=1e-6)
    (one,) = decoding.beam_search(model, src, beam=1, len_penalty=0.0, max_len_a=1.0, max_len_b=10)
    assert one == [([A], pytest.approx(math.log(0.24), abs=1e-6))]  # beam 1 is greedy


@pytest.mark.parametrize("alpha, winner", [(0.0, [A]), (1.0, [B, A])])
def test_stub_length_penalty_changes_the_winner(alpha, winner):
    model = StubModel({5: LENGTHS})
    (hyps,) = decoding.beam_search(model, stub_src([5, EOS]), beam=2, len_penalty=alpha, max_len_a=1.0,
                             max_len_b=10, nbest=2)
    lp = decoding.length_penalty
    expected = {(A,): math.log(0.55 * 0.5) / lp(2, alpha), (B, A): math.log(0.45 * 0.9 * 0.6) / lp(3, alpha)}
    assert hyps[0][0] == winner
    assert {tuple(t): s for t, s in hyps} == pytest.approx(expected, abs=1e-6)
    assert lp(2, 1.0) == pytest.approx(7 / 6) and lp(3, 0.6) == pytest.approx((8 / 6) ** 0.6)


def test_stub_stops_once_beam_hypotheses_are_finished():
    """fairseq's rule: done when `beam` hypotheses have ended, although beams "B A A"... are still alive."""
    model = StubModel({5: LENGTHS})
    decoding.beam_search(model, stub_src([5, EOS]), beam=2, len_penalty=1.0, max_len_a=1.0, max_len_b=10)
    assert model.calls == 3  # steps 0, 1, 2: "A" ends at step 1 and "B A" at step 2


def test_stub_nbest_is_sorted_and_prefix_of_larger_nbest():
    model = StubModel({5: LENGTHS})
    (three,) = decoding.beam_search(model, stub_src([5, EOS]), 3, 0.6, 1.0, 10, nbest=3)
    (two,) = decoding.beam_search(model, stub_src([5, EOS]), 3, 0.6, 1.0, 10, nbest=2)
    scores = [s for _, s in three]
    assert len(three) == 3 and scores == sorted(scores, reverse=True)
    assert len({tuple(t) for t, _ in three}) == 3
    assert two == three[:2]
    with pytest.raises(ValueError):
        decoding.beam_search(model, stub_src([5, EOS]), 2, 0.6, 1.0, 10, nbest=3)


def test_stub_eos_forced_at_max_length():
    model = StubModel({6: NO_END})
    src = stub_src([6, EOS])  # 2 real tokens: max length int(1.5 * 2 + 2) = 5
    assert decoding.greedy_search(model, src, 1.5, 2) == [[A] * 5]
    (hyps,) = decoding.beam_search(model, src, 2, 0.0, 1.5, 2)
    assert hyps == [([A] * 5, pytest.approx(5 * math.log(0.6) + math.log(0.1), abs=1e-5))]


@pytest.mark.parametrize("use_cache", [True, False])
def test_stub_batch_with_sentences_finishing_at_different_steps(use_cache):
    """Sentences leave the batch at steps 1, 2 and 5; the rest keep their own rows, prefixes and scores."""
    tables = {4: NOT_GREEDY, 5: LENGTHS, 6: NO_END}
    rows = [[6, 4, EOS], [4, EOS], [5, EOS], [4, 5, 6, EOS]]  # padded to different lengths
    model = StubModel(tables)
    batched = decoding.beam_search(model, stub_src(*rows), 2, 1.0, 1.0, 2, nbest=2, use_cache=use_cache)
    alone = [decoding.beam_search(model, stub_src(r), 2, 1.0, 1.0, 2, nbest=2, use_cache=use_cache)[0]
             for r in rows]
    assert batched == alone
    assert [h[0][0] for h in batched] == [[A] * 5, [B], [B, A], [B]]
    greedy = decoding.greedy_search(model, stub_src(*rows), 1.0, 2, use_cache=use_cache)
    assert greedy == [[A] * 5, [A], [A], [A]]


# ---------------------------------------------------------------- a real tiny Transformer


def tiny_model(attention="mha", seed=0):
    """Seeded random model; a scaled output layer (eos row more) makes choices peaked and lengths varied."""
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, n_enc_layers=2,
                      n_dec_layers=2, d_ff=64, dropout=0.0, attention=attention,
                      n_kv_heads=2 if attention == "gqa" else 0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.generator.weight.mul_(2.0)
        model.generator.weight[EOS].mul_(3.0)
    return model


def random_sources(lengths=(3, 7, 5, 12, 2, 9, 4, 6), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (n,), generator=g).tolist() + [EOS] for n in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_real_beam_one_equals_greedy_and_outputs_are_not_trivial(model):
    src = decoding.pad_batch(random_sources())
    with torch.inference_mode():
        greedy = decoding.greedy_search(model, src, 1.0, 5)
        beam1 = decoding.beam_search(model, src, 1, 0.6, 1.0, 5)
        beam4 = decoding.beam_search(model, src, 4, 0.6, 1.0, 5)
    assert [h[0][0] for h in beam1] == greedy
    lengths = {len(g) for g in greedy}
    assert len(lengths) > 2  # the fixture really ends sentences at different steps
    assert [h[0][0] for h in beam4] != greedy  # and beam search finds other hypotheses


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
def test_real_cached_equals_uncached(attention):
    model = tiny_model(attention)
    src = decoding.pad_batch(random_sources())
    with torch.inference_mode():
        assert decoding.greedy_search(model, src, 1.0, 5) == decoding.greedy_search(model, src, 1.0, 5, use_cache=False)
        cached = decoding.beam_search(model, src, 4, 0.6, 1.0, 5, nbest=4)
        uncached = decoding.beam_search(model, src, 4, 0.6, 1.0, 5, nbest=4, use_cache=False)
    assert [[t for t, _ in h] for h in cached] == [[t for t, _ in h] for h in uncached]
    for h, u in zip(cached, uncached, strict=True):
        assert [s for _, s in h] == pytest.approx([s for _, s in u], abs=1e-4)


def test_ensemble_of_one_model_twice_searches_as_the_model(model):
    src = decoding.pad_batch(random_sources())
    twice = decoding.Ensemble([model, model])
    with torch.inference_mode():
        assert decoding.greedy_search(twice, src, 1.0, 5) == decoding.greedy_search(model, src, 1.0, 5)
        alone = decoding.beam_search(model, src, 4, 0.6, 1.0, 5, nbest=4)
        ensemble = decoding.beam_search(twice, src, 4, 0.6, 1.0, 5, nbest=4)
    assert [[t for t, _ in h] for h in ensemble] == [[t for t, _ in h] for h in alone]
    for h, a in zip(ensemble, alone, strict=True):
        assert [s for _, s in h] == pytest.approx([s for _, s in a], abs=1e-5)


@pytest.mark.parametrize("second", ["mha", "mla"])
def test_ensemble_takes_the_mean_probability_and_caches_like_one_model(second):
    """Members of other widths and attention kinds: the ensemble's next-token log-probabilities are the log of
    the mean of theirs at every prefix, and its cached search equals its uncached one."""
    first = tiny_model(seed=0)
    torch.manual_seed(3)
    other = Transformer(ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=48, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=3, d_ff=96, dropout=0.0, attention=second)).eval()
    ens = decoding.Ensemble([first, other])
    src = decoding.pad_batch(random_sources()[:3])
    tgt = torch.randint(4, 40, (3, 6), generator=torch.Generator().manual_seed(2))
    tgt[:, 0] = BOS
    with torch.inference_mode():
        memory, mask = ens.encode(src)
        got = decoding.next_log_probs(ens, tgt, memory, mask, None)  # (3,V)
        probs = [decoding.next_log_probs(m, tgt, *m.encode(src), None).exp() for m in (first, other)]
        assert got.exp().sum(-1) == pytest.approx(torch.ones(3), abs=1e-5)
        assert torch.allclose(got.exp(), (probs[0] + probs[1]) / 2, atol=1e-6)
        assert not torch.allclose(probs[0], probs[1], atol=1e-2)  # the members really differ
        full = decoding.beam_search(ens, src, 4, 0.6, 1.0, 5, nbest=4, use_cache=False)
        cached = decoding.beam_search(ens, src, 4, 0.6, 1.0, 5, nbest=4)
        assert decoding.greedy_search(ens, src, 1.0, 5) == decoding.greedy_search(ens, src, 1.0, 5, use_cache=False)
    assert [[t for t, _ in h] for h in cached] == [[t for t, _ in h] for h in full]


def test_real_greedy_equals_argmax_of_the_training_forward_pass(model):
    """An independent reference: run model(src, tgt_in) on the growing prefix, take the argmax each step."""
    a, b = 1.0, 3
    for src in random_sources()[:4]:
        ys = [BOS]
        with torch.inference_mode():
            while len(ys) <= int(a * len(src) + b):
                logits = model(torch.tensor([src]), torch.tensor([ys]))[0, -1]  # (V,)
                logits[[PAD, BOS]] = -math.inf
                if int(logits.argmax()) == EOS:
                    break
                ys.append(int(logits.argmax()))
            assert decoding.greedy_search(model, torch.tensor([src]), a, b) == [ys[1:]]


def test_real_bf16_autocast_decodes(model):
    lines = ["a b c", "d e f g"]
    out = decoding.search_texts(model, ToyTokenizer(), lines, beam=3, nbest=3, greedy_ok=False, precision="bf16",
                          max_len_b=5)
    assert len(out) == 2 and all(math.isfinite(s) for h in out for _, s in h)


def test_real_batched_equals_one_by_one(model):
    sources = random_sources()
    with torch.inference_mode():
        batched = decoding.beam_search(model, decoding.pad_batch(sources), 4, 0.6, 1.0, 5, nbest=2)
        alone = [decoding.beam_search(model, decoding.pad_batch([s]), 4, 0.6, 1.0, 5, nbest=2)[0] for s in sources]
        greedy = decoding.greedy_search(model, decoding.pad_batch(sources), 1.0, 5)
        greedy_alone = [decoding.greedy_search(model, decoding.pad_batch([s]), 1.0, 5)[0] for s in sources]
    assert greedy == greedy_alone
    assert [[t for t, _ in h] for h in batched] == [[t for t, _ in h] for h in alone]
    for h, u in zip(batched, alone, strict=True):
        assert [s for _, s in h] == pytest.approx([s for _, s in u], abs=1e-4)


def test_real_output_length_bounded(model):
    sources = random_sources()
    a, b = 0.5, 2
    with torch.inference_mode():
        greedy = decoding.greedy_search(model, decoding.pad_batch(sources), a, b)
        beam = decoding.beam_search(model, decoding.pad_batch(sources), 4, 0.6, a, b, nbest=4)
    limits = [int(a * len(s) + b) for s in sources]
    assert all(len(g) <= n for g, n in zip(greedy, limits, strict=True))
    assert all(len(t) <= n for h, n in zip(beam, limits, strict=True) for t, _ in h)
    assert any(len(g) == n for g, n in zip(greedy, limits, strict=True))  # the bound is reached exactly


# ---------------------------------------------------------------- text in, text out; scores


class ToyTokenizer:
    """Words hashed onto ids 4..39: enough to exercise batching, ordering and empty lines."""

    src_vocab_size = tgt_vocab_size = 40

    def encode_src(self, text):
        return [4 + sum(map(ord, w)) % 36 for w in text.split()] + [EOS]

    def decode_tgt(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_translate_texts_order_empty_lines_and_batches():
    model, tok = tiny_model(seed=4), ToyTokenizer()  # seed 4: different outputs for different lines
    lines = ["a b c", "", "   ", "d e", "a b c", "f g h i j k l", "\t", "m"]
    opts = dict(beam=4, max_len_b=5)
    out = decoding.translate_texts(model, tok, lines, batch_tokens=1000, **opts)
    assert len(out) == len(lines)
    assert out[1] == out[2] == out[6] == ""
    assert out[0] == out[4]
    assert len(set(out)) > 3
    assert out == decoding.translate_texts(model, tok, lines, batch_tokens=6, **opts)  # one or two per batch
    assert out == [decoding.translate_texts(model, tok, [line], **opts)[0] for line in lines]
    nbest = decoding.translate_nbest(model, tok, lines, 3, **opts)
    assert [n[0][0] for n in nbest] == out and nbest[1] == [("", 0.0)]
    assert all(len(n) == 3 and [s for _, s in n] == sorted([s for _, s in n], reverse=True)
               for i, n in enumerate(nbest) if lines[i].strip())
    assert model.training is False


def test_translate_texts_truncates_overlong_lines_with_a_warning(model, capsys):
    tok = ToyTokenizer()
    words = [f"x{i}" for i in range(300)]
    out = decoding.translate_texts(model, tok, [" ".join(words), "a b"], beam=2, max_src_len=16)
    assert "line 1 has 301 source tokens" in capsys.readouterr().err
    assert out == decoding.translate_texts(model, tok, [" ".join(words[:15]), "a b"], beam=2)


def test_length_batches_cover_all_and_respect_the_budget():
    lengths = [5, 1, 9, 3, 3, 7, 2, 8, 4, 6]
    batches = decoding.length_batches(lengths, 12)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 12 for b in batches)
    assert decoding.length_batches([20, 3], 12) == [[0], [1]]  # a line above the budget still gets its own batch


def test_score_against_known_values():
    same = scoring.score(["Ein Hund läuft.", "Zwei Männer."], ["Ein Hund läuft.", "Zwei Männer."], "de")
    assert same["bleu"] == pytest.approx(100.0) and same["chrf"] == pytest.approx(100.0)
    assert same["bleu_tok_lc"] == pytest.approx(100.0)
    s = scoring.score(["The cat sat on the mat."], ["the cat sat on a mat."], "en")
    # Moses tokens, lowercased: precisions 6/7, 4/6, 2/5, 1/4, same length (no brevity penalty).
    assert s["bleu_tok_lc"] == pytest.approx(100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25, abs=0.01)
    assert s["bleu"] < s["bleu_tok_lc"]  # cased: "The" does not match "the"
    assert s["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "lc:yes" in s["bleu_tok_lc_signature"] or "case:lc" in s["bleu_tok_lc_signature"]
    assert "BLEU (tokenized, lowercased)" in scoring.format_scores(s)
    with pytest.raises(UserError, match="2 translations but 1 reference"):
        scoring.score(["a", "b"], ["a"], "en")


# ---------------------------------------------------------------- checkpoints and the command line


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the trainer leaves it: config.yaml, tokenizer/, checkpoint_last.pt (random)."""
    root = tmp_path_factory.mktemp("translate_cli")
    data = fixture_data(root / "prepared")
    with contextlib.redirect_stdout(io.StringIO()):
        tokenizer = dp.load_tokenizer(dp.prepare(DataConfig(**data)))
    model_cfg = dict(src_vocab_size=tokenizer.src_vocab_size, tgt_vocab_size=tokenizer.tgt_vocab_size,
                     d_model=32, n_heads=4, n_enc_layers=2, n_dec_layers=2, d_ff=64, dropout=0.0,
                     share_embeddings=True)
    cfg = config_from_dict({"data": data, "model": model_cfg, "decode": {"beam": 3, "max_len_b": 8}})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    run = root / "run"
    tokenizer.save(run / "tokenizer")
    save_config(cfg, run / "config.yaml")
    state = {"model": model.state_dict(), "config": config_to_dict(cfg), "step": 0}
    torch.save(state, run / "checkpoint_last.pt")
    return run


def cli(*args, stdin=None, timeout=120):
    """translate.py in a subprocess, bytes in and out, as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "translate.py"), *map(str, args)], input=stdin,
                          capture_output=True, timeout=timeout, env=CLI_ENV, cwd=ROOT)


def run_main(capsys, *args):
    """translate.main in this process (fast), as the script runs it: (status, stdout, stderr)."""
    return run_in_process(tr.main, capsys, *args)


def test_load_checkpoint_prefers_avg_then_best_then_last(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert checkpoint.find_checkpoint(run).name == "checkpoint_last.pt"
    shutil.copy(run / "checkpoint_last.pt", run / "checkpoint_best.pt")
    assert checkpoint.find_checkpoint(run).name == "checkpoint_best.pt"
    shutil.copy(run / "checkpoint_last.pt", run / "checkpoint_avg.pt")
    assert checkpoint.find_checkpoint(run).name == "checkpoint_avg.pt"
    model, tokenizer, cfg = checkpoint.load_checkpoint(run / "checkpoint_last.pt")
    assert cfg.decode.beam == 3 and not model.training
    assert tokenizer.tgt_vocab_size == cfg.model.tgt_vocab_size


def test_cli_sentences_and_plot_attention(run_dir, tmp_path):
    png = tmp_path / "attn.png"
    proc = cli("--checkpoint", run_dir, "A man is riding a bike.", "--plot-attention", png)
    assert proc.returncode == 0, proc.stderr.decode()
    model, tokenizer, _ = checkpoint.load_checkpoint(run_dir)
    expected = decoding.translate_texts(model, tokenizer, ["A man is riding a bike."], beam=3, max_len_b=8)
    assert proc.stdout.decode("utf-8") == expected[0] + "\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_ensemble_of_two_runs_and_its_refusals(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    state = torch.load(other / "checkpoint_last.pt")
    torch.manual_seed(5)
    state["model"] = Transformer(config_from_dict(state["config"]).model).state_dict()
    torch.save(state, other / "checkpoint_last.pt")
    sentences = ["A man is riding a bike.", "Two dogs play in the snow.", "A woman sings."]
    status, out, err = run_main(capsys, "--checkpoint", run_dir, "--checkpoint", other, *sentences)
    assert status == 0, err
    models = [checkpoint.load_checkpoint(path)[0] for path in (run_dir, other)]
    _, tokenizer, _ = checkpoint.load_checkpoint(run_dir)
    expected = decoding.translate_texts(decoding.Ensemble(models), tokenizer, sentences, beam=3, max_len_b=8)
    alone = [decoding.translate_texts(m, tokenizer, sentences, beam=3, max_len_b=8) for m in models]
    assert out.splitlines() == expected and expected not in alone
    for extra, message in [(["--plot-attention", tmp_path / "a.png"], "an ensemble"),
                           (["--serve"], "--serve serves one model")]:
        status, _, err = run_main(capsys, "--checkpoint", run_dir, "--checkpoint", other, sentences[0], *extra)
        assert status != 0 and message in err
    (other / "tokenizer" / "tokenizer.json").write_text(
        (other / "tokenizer" / "tokenizer.json").read_text().replace('"src_lang": "en"', '"src_lang": "fr"'))
    status, _, err = run_main(capsys, "--checkpoint", run_dir, "--checkpoint", other, sentences[0])
    assert status != 0 and "was trained with another tokenizer" in err
    from translator import Translator

    with pytest.raises(ValueError, match="ensemble"):
        Translator.load_ensemble([run_dir, run_dir], device="cpu").translate(sentences[:1], attention=True)


def test_cli_streams_stdin_line_by_line(run_dir):
    """One output line per input line, printed before the next line is read; CRLF, blanks, odd characters."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--checkpoint", str(run_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=CLI_ENV)
    try:
        proc.stdin.write(b"A man is riding a bike.\r\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no output while standard input is still open: the translation is not streamed"
        first = proc.stdout.readline()
        rest, err = proc.communicate("\r\n   \nÉté 😀 \x0c ctrl\x1b\nTwo dogs play.".encode(), timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    lines = (first + rest).decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 6  # five input lines (the last without newline), five outputs
    assert lines[1] == lines[2] == "" and b"\r" not in first + rest
    model, tokenizer, _ = checkpoint.load_checkpoint(run_dir)
    expected = decoding.translate_texts(model, tokenizer, ["A man is riding a bike."], beam=3, max_len_b=8)
    assert lines[0] == expected[0]


def test_cli_input_output_reference_split_json(run_dir, tmp_path, capsys):
    src = tmp_path / "in.en"
    src.write_bytes(b"A dog runs.\r\n\r\nTwo women talk.\n")
    out = tmp_path / "out.de"
    status, stdout, err = run_main(capsys, "--checkpoint", run_dir, "--input", src, "--output", out)
    assert status == 0 and stdout == "", err
    assert out.read_text("utf-8").split("\n")[1::2] == ["", ""]  # 3 lines, the 2nd empty, newline-ended
    status, stdout, err = run_main(capsys, "--checkpoint", run_dir, "--reference", "test", "--json",
                                   "--output", out)
    assert status == 0, err
    scores = json.loads(stdout)
    assert {"bleu", "chrf", "bleu_tok_lc", "signature", "sentences"} <= set(scores)
    assert scores["sentences"] == 10
    assert len(out.read_text("utf-8").split("\n")) == 11
    ref = tmp_path / "ref.de"
    ref.write_text(out.read_text("utf-8"), encoding="utf-8")  # the output as its own reference: BLEU 100
    status, stdout, err = run_main(capsys, "--checkpoint", run_dir, "--input", FIXTURES / "test.en",
                                   "--reference", ref, "--output", tmp_path / "again.de")
    assert status == 0, err
    assert "BLEU (cased, detokenized)" in stdout and " 100.00 " in stdout


def test_cli_nbest_lines(run_dir, capsys):
    status, stdout, err = run_main(capsys, "--checkpoint", run_dir, "--nbest", "2", "A cat.", "", "Two men.")
    assert status == 0, err
    rows = [line.split("\t") for line in stdout.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "2", "2"]  # the empty line gives one empty hypothesis
    assert float(rows[0][1]) >= float(rows[1][1]) and rows[2][1:] == ["0.0000", ""]
    status, _, err = run_main(capsys, "--checkpoint", run_dir, "--nbest", "4", "A cat.")
    assert status == 2 and "--nbest must be between 1 and the beam (3)" in err


def test_cli_corrupt_checkpoint_is_one_line_error(run_dir, tmp_path):
    bad = tmp_path / "checkpoint_last.pt"
    bad.write_bytes((run_dir / "checkpoint_last.pt").read_bytes()[:3000])  # truncated copy
    proc = cli("--checkpoint", bad, "A man.")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b""
    assert err.startswith("error: cannot read checkpoint") and err.count("\n") == 1 and "Traceback" not in err


def corrupt(run: Path, what: str) -> Path:
    """Damage a copy of a run directory in one way; return the --checkpoint argument to give."""
    ckpt = run / "checkpoint_last.pt"
    if what == "missing":
        return run / "nope"
    if what == "empty_dir":
        shutil.rmtree(run / "tokenizer")
        ckpt.unlink()
        return run
    if what == "pt_is_dir":
        (run / "checkpoint_best.pt").mkdir()
        return run
    if what == "not_a_checkpoint":
        torch.save({"weights": torch.zeros(2)}, ckpt)
        return ckpt
    if what == "unsafe_object":
        torch.save({"model": {}, "config": {}, "rng": np.zeros(3)}, ckpt)  # numpy: refused by weights_only
        return ckpt
    if what == "garbage":
        ckpt.write_bytes(b"\x00not a zip file at all" * 20)
        return ckpt
    state = torch.load(ckpt, weights_only=True)
    if what == "wrong_config":
        state["config"]["model"]["d_ff"] = 128
    elif what == "unknown_key":
        state["config"]["model"]["d_fff"] = 128
    elif what == "no_tokenizer":
        shutil.rmtree(run / "tokenizer")
    elif what == "other_tokenizer":
        state["config"]["model"]["src_vocab_size"] += 1
        state["config"]["model"]["tgt_vocab_size"] += 1
        state["config"]["model"]["share_embeddings"] = True
        state["model"] = Transformer(config_from_dict(state["config"]).model).state_dict()
    torch.save(state, ckpt)
    return ckpt


@pytest.mark.parametrize("what, message", [
    ("missing", "checkpoint not found"), ("empty_dir", "no checkpoint in"),
    ("pt_is_dir", "is a directory, expected a checkpoint file"), ("not_a_checkpoint", "is not a checkpoint"),
    ("garbage", "cannot read checkpoint"), ("unsafe_object", "refusing to load"),
    ("wrong_config", "does not match its model config"),
    ("unknown_key", "unusable config: unknown key 'model.d_fff'"),
    ("no_tokenizer", "tokenizer folder not found"),
    ("other_tokenizer", "it belongs to another run"),
])
def test_bad_checkpoints_are_one_line_user_errors(run_dir, tmp_path, capsys, what, message):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    status, out, err = run_main(capsys, "--checkpoint", corrupt(run, what), "A man.")
    assert status == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [
    (["--input", "missing.txt"], "file not found"),
    (["--reference", "no_such_split"], "no such file, and not a split"),
    (["--plot-attention", "x.png", "one", "two"], "exactly one sentence"),
    (["--beam", "0", "x"], "--beam must be >= 1"),
    (["--device", "cuda:0", "x"] if not torch.cuda.is_available() else ["--device", "tpu", "x"], "device"),
    (["--layer", "7", "--plot-attention", "x.png", "A dog."], "--layer 7 is out of range"),
])
def test_bad_arguments_are_one_line_user_errors(run_dir, tmp_path, capsys, args, message):
    status, out, err = run_main(capsys, "--checkpoint", run_dir, *args)
    assert status == 2 and message in err and err.count("\n") == 1, err


def test_cli_rejects_non_utf8_input(run_dir, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\nÉté\n".encode("latin-1"))
    status, out, err = run_main(capsys, "--checkpoint", run_dir, "--input", bad)
    assert status == 2 and "not UTF-8 text (bad byte on line 2)" in err
