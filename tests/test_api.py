"""Tests of translator.py, the Python entry point: the same results as decoding.translate_texts /
translate_nbest, the attention it returns, and clear errors for bad arguments."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from conftest import fixture_lines

import decoding
from checkpoint import load_checkpoint
from data_preparation import BOS_ID
from runtime import UserError
from translator import Translation, Translator

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = [*fixture_lines("test", "en")[:6], "", "A dog runs."]


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def reference(run):
    """(model, tokenizer, cfg) loaded the way translate.py loads them."""
    return load_checkpoint(run, "cpu")


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_best_translation_equals_translate_texts(translator, reference, beam):
    model, tokenizer, cfg = reference
    expected = decoding.translate_texts(model, tokenizer, SENTENCES, beam=beam, len_penalty=cfg.decode.len_penalty,
                                        max_len_a=cfg.decode.max_len_a, max_len_b=cfg.decode.max_len_b)
    got = translator.translate(SENTENCES, beam=beam)
    assert [t.text for t in got] == expected
    assert all(isinstance(t, Translation) and t.attention is None for t in got)
    assert all(len(t.hypotheses) == 1 and t.hypotheses[0] == (t.text, t.score) for t in got)
    if beam == 1:  # greedy search keeps no score
        assert all(t.score is None for t in got if t.text)
    else:
        assert all(isinstance(t.score, float) and t.score < 0 for t in got if t.text)


def test_defaults_come_from_the_checkpoint(translator, reference):
    model, tokenizer, cfg = reference
    found = decoding.search_texts(model, tokenizer, SENTENCES, beam=cfg.decode.beam,
                                  len_penalty=cfg.decode.len_penalty, max_len_a=cfg.decode.max_len_a,
                                  max_len_b=cfg.decode.max_len_b)
    got = translator.translate(SENTENCES)
    assert translator.default_beam == cfg.decode.beam == 2  # configs/tiny.yaml
    assert [t.score for t in got] == [h[0][1] for h in found]


@pytest.mark.parametrize("beam,nbest,len_penalty", [(2, 2, 0.6), (4, 3, 1.0), (3, 1, 0.0)])
def test_nbest_equals_translate_nbest(translator, reference, beam, nbest, len_penalty):
    model, tokenizer, cfg = reference
    opts = dict(beam=beam, len_penalty=len_penalty, max_len_a=1.0, max_len_b=7)
    expected = decoding.translate_nbest(model, tokenizer, SENTENCES, nbest, **opts)
    got = translator.translate(SENTENCES, nbest=nbest, **opts)
    assert [t.hypotheses for t in got] == expected
    assert [t.text for t in got] == [e[0][0] for e in expected]
    assert all(len(t.hypotheses) == (nbest if t.text else 1) for t in got)


def test_max_len_bounds_the_output(translator, reference):
    _, tokenizer, _ = reference
    got = translator.translate(SENTENCES, beam=2, max_len_a=0, max_len_b=2, attention=True)
    assert all(len(t.tgt_tokens) <= 3 for t in got)  # at most 2 tokens, then eos


def test_attention_matches_forward_with_attention(translator, reference):
    model, tokenizer, _ = reference
    (t,) = translator.translate(["A dog runs in the snow."], beam=2, attention=True)
    (found,) = decoding.search_texts(model, tokenizer, ["A dog runs in the snow."], beam=2, len_penalty=0.6,
                                     max_len_a=1.0, max_len_b=10)
    tokens = found[0][0]
    src = torch.tensor([tokenizer.encode_src("A dog runs in the snow.")])
    with torch.inference_mode():
        cross = model.forward_with_attention(src, torch.tensor([[BOS_ID, *tokens]])).cross
    assert t.src_tokens == tokenizer.src_pieces("A dog runs in the snow.") and t.src_tokens[-1] == "<eos>"
    assert t.tgt_tokens[-1] == "<eos>" and len(t.tgt_tokens) == len(tokens) + 1
    assert len(t.attention) == model.cfg.n_dec_layers
    for layer, weights in zip(cross, t.attention, strict=True):
        got = torch.tensor(weights)  # [head][tgt][src]
        assert got.shape == (model.cfg.n_heads, len(t.tgt_tokens), len(t.src_tokens))
        torch.testing.assert_close(got, layer[0].float())
        torch.testing.assert_close(got.sum(dim=-1), torch.ones(got.shape[:2]))  # each row is a distribution


def test_attention_of_an_empty_line_is_empty(translator):
    (t,) = translator.translate(["   "], attention=True)
    assert (t.text, t.score, t.src_tokens, t.tgt_tokens, t.attention) == ("", 0.0, [], [], [])


def test_threads_share_a_translator(translator):
    expected = [t.text for t in translator.translate(SENTENCES)]
    results: list = [None] * 4

    def work(i: int) -> None:
        results[i] = [t.text for t in translator.translate(SENTENCES)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert results == [expected] * 4


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(beam=0), ValueError, "beam=0 must be >= 1"),
    (dict(beam=2, nbest=3), ValueError, "nbest=3 must be between 1 and 2"),
    (dict(nbest=0), ValueError, "nbest=0 must be between 1"),
    (dict(beam=2.0), TypeError, "beam must be an int"),
    (dict(beam=True), TypeError, "beam must be an int"),
    (dict(len_penalty=math.nan), ValueError, "len_penalty=nan must be a finite number"),
    (dict(max_len_a=math.inf), ValueError, "max_len_a=inf must be a finite number"),
    (dict(max_len_b=-1), ValueError, "max_len_b=-1 must be >= 0"),
    (dict(len_penalty="0.6"), TypeError, "len_penalty must be a number"),
    (dict(attention="yes"), TypeError, "attention must be a bool"),
])
def test_bad_arguments_raise(translator, kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        translator.translate(["A dog runs."], **kwargs)


@pytest.mark.parametrize("texts,message", [("A dog runs.", "texts must be a list of strings"),
                                           (["ok", 3], r"texts\[1\] must be a string")])
def test_bad_texts_raise(translator, texts, message):
    with pytest.raises(TypeError, match=message):
        translator.translate(texts)


def test_load_errors_are_one_line(run, tmp_path):
    with pytest.raises(UserError, match="is not a CTranslate2 export .*export it first: python export.py"):
        Translator.load(run, engine="ctranslate2")
    with pytest.raises(UserError, match="engine 'onnx' is unknown; use auto, torch, ctranslate2"):
        Translator.load(run, engine="onnx")
    with pytest.raises(UserError, match="precision int8 needs engine ctranslate2"):
        Translator.load(run, precision="int8")
    with pytest.raises(UserError, match="precision 'fp8' is unknown"):
        Translator.load(run, precision="fp8")
    with pytest.raises(UserError, match="checkpoint not found"):
        Translator.load(tmp_path / "nowhere")
    with pytest.raises(UserError, match="is not a device"):
        Translator.load(run, device="gpu0")


def test_load_a_checkpoint_file_and_batch_tokens(run):
    small = Translator.load(run / "checkpoint_last.pt", device="cpu", batch_tokens=8)
    assert small.name == "run/checkpoint_last.pt" and small.batch_tokens == 8
    model, tokenizer, cfg = load_checkpoint(run / "checkpoint_last.pt")
    expected = decoding.translate_texts(model, tokenizer, SENTENCES, beam=2, max_len_b=10)
    assert [t.text for t in small.translate(SENTENCES, beam=2)] == expected  # tiny batches, same output
