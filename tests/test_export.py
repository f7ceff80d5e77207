"""Tests of export.py and ct2_engine.py: a CTranslate2 export scores and translates as our PyTorch model does.

Seeded random models of every attention variant check the weight mapping (token log-probabilities to 1e-4) and
the search rules; a tiny model trained by the real script checks greedy and beam outputs end to end."""

import contextlib
import io
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, fixture_data, fixture_lines, run_script, unexplained_differences

import checkpoint
import ct2_engine
import data_preparation as dp
import decoding
import export
from config import DataConfig, config_from_dict, config_to_dict
from runtime import UserError, cli_main
from transformer_model import ModelConfig, Transformer

ct2 = pytest.importorskip("ctranslate2")  # the modules above import it only when used
pytestmark = pytest.mark.usefixtures("one_thread")
ENV = {"OMP_NUM_THREADS": "1", "NMT_DEBUG": "0"}
SOURCES = fixture_lines("test", "en") + fixture_lines("val", "en")
REFS = fixture_lines("test", "de") + fixture_lines("val", "de")

# ---------------------------------------------------------------- helpers


def teacher_forced(model, tokenizer, sources: list[str], refs: list[str]) -> list[list[float]]:
    """Our model's log-probability of each reference token and the final eos, one sentence at a time."""
    out = []
    with torch.inference_mode():
        for src, ref in zip(sources, refs, strict=True):
            ids = tokenizer.encode_tgt(ref)
            logits = model(torch.tensor([tokenizer.encode_src(src)]), torch.tensor([[dp.BOS_ID, *ids]]))[0]
            lp = logits.float().log_softmax(dim=-1)
            out.append([lp[i, t].item() for i, t in enumerate([*ids, dp.EOS_ID])])
    return out


def ct2_token_log_probs(engine, sources: list[str], refs: list[str]) -> list[list[float]]:
    """CTranslate2's score_batch log-probabilities per target token (it appends the eos itself)."""
    src = engine.source_tokens(sources)
    tgt = [[engine.tgt_vocab[i] for i in engine.tokenizer.encode_tgt(r)] for r in refs]
    return [list(r.log_probs) for r in engine.translator.score_batch(src, tgt)]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


# ---------------------------------------------------------------- random models of every variant


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The fixture corpus' BPE tokenizer (trained in milliseconds)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return dp.load_tokenizer(dp.prepare(DataConfig(**fixture_data(tmp_path_factory.mktemp("prep")))))


def random_run(folder: Path, tokenizer, seed: int = 3, **model) -> Path:
    """A run directory holding a seeded random model with nonzero biases and peaked, varied-length outputs.

    pad and bos get a logit of about -16 (their output rows are -1 and the final LayerNorm's bias is 0.5; with
    ScaleNorm, the last feed-forward's bias of 0.5 tilts the normalised output the same way): ours
    masks them after the softmax, CTranslate2 before it, which agree only when their probability is ~0, as in
    a trained model."""
    fields = dict(src_vocab_size=tokenizer.src_vocab_size, tgt_vocab_size=tokenizer.tgt_vocab_size, d_model=32,
                  n_heads=4, n_enc_layers=2, n_dec_layers=2, d_ff=64, dropout=0.0, max_positions=128, **model)
    torch.manual_seed(seed)
    output_ids = None
    if model.get("output_vocab") == "target":  # the references' tokens, eos and unk, and a random half of the rest
        needed = {dp.EOS_ID, dp.UNK_ID, *(t for ref in REFS for t in tokenizer.encode_tgt(ref))}
        others = [t for t in range(tokenizer.tgt_vocab_size) if t not in needed]
        chosen = [others[i] for i in torch.randperm(len(others))[: len(others) // 2].tolist()]
        output_ids = torch.tensor(sorted(needed.union(chosen)))
        fields["output_size"] = len(output_ids)
    cfg = config_from_dict({"data": fixture_data(folder / "prepared", tokenizer=tokenizer.kind), "model": fields,
                            "decode": {"beam": 4, "len_penalty": 0.6, "max_len_b": 50}})
    m = Transformer(cfg.model).eval()
    if output_ids is not None:
        m.output_ids.copy_(output_ids)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:  # biases and LayerNorm parameters: the mapping of each is checked
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
            elif p.dim() == 0:  # ScaleNorm gains, each its own value
                p.mul_(torch.rand(()) + 0.5)
        m.generator.weight.mul_(2.0)
        m.generator.weight[dp.EOS_ID].mul_(3.0)
        m.generator.weight[[dp.PAD_ID, dp.BOS_ID]] = -1.0
        if cfg.model.norm == "layer":
            (m.dec_norm if cfg.model.norm_first else m.decoder[-1].norm3).bias.fill_(0.5)
        else:  # ScaleNorm has no bias: an offset along the all-ones direction before the last norm does its job
            m.decoder[-1].ff.w2.bias.fill_(0.5)
        if cfg.model.fix_norm:  # unit rows undo the scaling above: a wider final norm makes the logits peaked instead
            m.dec_norm.weight.mul_(6.0)
            m.dec_norm.bias.mul_(6.0)
    tokenizer.save(folder / "tokenizer")
    torch.save({"model": m.state_dict(), "config": config_to_dict(cfg), "step": 0}, folder / "checkpoint_last.pt")
    return folder


VARIANTS = {
    "mha post-norm shared": dict(share_embeddings=True),
    "mha pre-norm untied": dict(norm_first=True, tie_output=False),
    "mqa": dict(attention="mqa", share_embeddings=True),
    "gqa pre-norm": dict(attention="gqa", n_kv_heads=2, norm_first=True, tie_output=False),
    "mla both latents": dict(attention="mla", kv_latent_dim=8, q_latent_dim=12, tie_output=False),
    "mla pre-norm": dict(attention="mla", kv_latent_dim=8, norm_first=True, share_embeddings=True),
    "target output vocabulary": dict(norm_first=True, share_embeddings=True, output_vocab="target"),
    "scale norm pre-norm": dict(norm="scale", norm_first=True, share_embeddings=True),
    "fix norm target vocab": dict(fix_norm=True, norm_first=True, share_embeddings=True, output_vocab="target"),
}


def limits(model, tokenizer, lines: list[str], a: float = 1.0, b: float = 50) -> list[int]:
    """translate.py's maximum output length of each line."""
    return [int(decoding.max_lengths(model, torch.ones(1, len(tokenizer.encode_src(line))), a, b)) for line in lines]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_log_probs_and_outputs_match(variant, tokenizer, tmp_path):
    """Weights map exactly; greedy is identical, and beam search wherever the best hypothesis ends by eos
    before the maximum length (random models often loop until that limit, where CTranslate2 may differ)."""
    run = random_run(tmp_path / "run", tokenizer, **VARIANTS[variant])
    model, tok, _ = checkpoint.load_checkpoint(run)
    engine = ct2_engine.load(export.export_ctranslate2(run, tmp_path / "ct2"), threads=1)
    ours = teacher_forced(model, tok, SOURCES, REFS)
    assert max_diff(ours, ct2_token_log_probs(engine, SOURCES, REFS)) < 1e-4
    for x, y in zip(ours, engine.score(SOURCES, REFS), strict=True):
        assert y == pytest.approx(sum(x), abs=1e-3)
    limit = limits(model, tok, SOURCES)
    for beam, alpha in [(1, 0.0), (4, 0.6)]:
        expected = decoding.search_texts(model, tok, SOURCES, beam=beam, len_penalty=alpha, max_len_a=1.0, max_len_b=50,
                                   nbest=beam, greedy_ok=False)
        found = engine.translate(SOURCES, beam=beam, nbest=beam, len_penalty=alpha, max_len_a=1.0, max_len_b=50)
        for x, y, n in zip(expected, found, limit, strict=True):
            if beam == 1 or len(x[0][0]) < n:
                assert y[0][0] == tok.decode_tgt(x[0][0]) and y[0][1] == pytest.approx(x[0][1], abs=1e-4)


def test_beam_rules_on_many_sentences(tokenizer, tmp_path):
    """Stopping rule, GNMT penalty and n-best lists on 62 sentences that all end before their limit."""
    run = random_run(tmp_path / "run", tokenizer, **VARIANTS["gqa pre-norm"])  # seed 3: varied lengths
    model, tok, _ = checkpoint.load_checkpoint(run)
    engine = ct2_engine.load(export.export_ctranslate2(run, tmp_path / "ct2"), threads=1)
    lines = SOURCES + fixture_lines("train", "en")
    limit = limits(model, tok, lines)
    for beam, alpha in [(2, 0.0), (4, 0.0), (4, 1.0), (8, 0.6)]:
        expected = decoding.search_texts(model, tok, lines, beam=beam, len_penalty=alpha, max_len_a=1.0, max_len_b=50,
                                   nbest=beam, greedy_ok=False)
        assert all(len(h[0][0]) < n for h, n in zip(expected, limit, strict=True))
        assert len({len(h[0][0]) for h in expected}) >= 5  # varied lengths, not one degenerate answer
        found = engine.translate(lines, beam=beam, nbest=beam, len_penalty=alpha)
        texts = [[tok.decode_tgt(ids) for ids, _ in hyps] for hyps in expected]
        same = sum(x[0] == y[0][0] for x, y in zip(texts, found, strict=True))
        assert same >= 0.99 * len(lines), (beam, alpha, same)
        same_lists = sum(x == [h for h, _ in y] for x, y in zip(texts, found, strict=True))
        assert same_lists >= 0.95 * len(lines), (beam, alpha, same_lists)


def test_long_lines_are_cut_as_translate_py_does(tokenizer, tmp_path, capsys):
    run = random_run(tmp_path / "run", tokenizer, **VARIANTS["gqa pre-norm"])
    model, tok, _ = checkpoint.load_checkpoint(run)
    engine = ct2_engine.load(export.export_ctranslate2(run, tmp_path / "ct2"), threads=1)
    lines = ["", " ".join(SOURCES) * 2, SOURCES[0]]  # line 2 is far over max_positions (128) tokens
    ours = decoding.translate_texts(model, tok, lines, beam=1)
    ours_warning = capsys.readouterr().err
    assert [h[0][0] for h in engine.translate(lines, beam=1)] == ours
    assert capsys.readouterr().err == ours_warning and "input line 2 has" in ours_warning


def test_spacy_tokenizer_gets_two_vocabularies(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        spacy_tok = dp.load_tokenizer(dp.prepare(DataConfig(**fixture_data(tmp_path / "prep", tokenizer="spacy"))))
    assert spacy_tok.src_vocab_size != spacy_tok.tgt_vocab_size
    run = random_run(tmp_path / "run", spacy_tok, tie_output=False)
    model, tok, _ = checkpoint.load_checkpoint(run)
    out = export.export_ctranslate2(run, tmp_path / "ct2")
    assert (out / "source_vocabulary.json").is_file() and (out / "target_vocabulary.json").is_file()
    engine = ct2_engine.load(out, threads=1)
    assert max_diff(teacher_forced(model, tok, SOURCES, REFS), ct2_token_log_probs(engine, SOURCES, REFS)) < 1e-4


def test_qk_norm_model_is_refused_in_one_line():
    cfg = ModelConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=16, n_heads=4, n_enc_layers=1, n_dec_layers=1,
                      d_ff=32, qk_norm=9.5)
    with pytest.raises(UserError, match="no QKNorm"):
        export.build_spec(ct2, Transformer(cfg), [], [])


def test_vocabulary_refuses_what_ctranslate2_cannot_hold():
    class Pieces:
        def __init__(self, pieces):
            self.list = pieces

        def vocab_size(self, lang):
            return len(self.list)

        def pieces(self, ids, lang):
            return [self.list[i] for i in ids]

    specials = list(dp.SPECIALS)
    assert export.vocabulary(Pieces([*specials, "a", "b"]), "de") == [*specials, "a", "b"]
    with pytest.raises(UserError, match="'a' twice"):
        export.vocabulary(Pieces([*specials, "a", "b", "a"]), "de")
    with pytest.raises(UserError, match="expected"):
        export.vocabulary(Pieces(["<s>", "</s>", "<unk>", "<pad>", "a"]), "de")


def test_mla_fold_is_a_plain_projection(tokenizer, tmp_path):
    """The folded MLA weights give the keys and values the latent path computes."""
    run = random_run(tmp_path / "run", tokenizer, attention="mla", kv_latent_dim=8, q_latent_dim=12)
    model, _, _ = checkpoint.load_checkpoint(run)
    attn = model.decoder[0].self_attn
    x = torch.randn(3, 5, 32)
    (w_q, b_q), (w_kv, b_kv) = export.attention_weights(attn)
    with torch.no_grad():
        q_latent, c_kv = attn.qkv_proj(x).split(attn.widths, dim=-1)
        k, v = attn.expand_kv((c_kv,))  # (B,H,N,Dh) each
        kv = torch.cat([t.transpose(1, 2).reshape(3, 5, -1) for t in (k, v)], dim=-1)
        torch.testing.assert_close(x.double() @ w_kv.T + b_kv, kv.double(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.double() @ w_q.T + b_q, attn.q_up(q_latent).double(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- a tiny trained model, end to end


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return checkpoint.load_checkpoint(tiny_run)  # (model, tokenizer, cfg)


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory) -> Path:
    return export.export_ctranslate2(tiny_run, tmp_path_factory.mktemp("export") / "fp32")


@pytest.fixture(scope="module")
def engine(exported):
    return ct2_engine.load(exported, threads=1)


@pytest.mark.slow
def test_trained_log_probs_match(tiny, engine):
    model, tok, _ = tiny
    assert max_diff(teacher_forced(model, tok, SOURCES, REFS), ct2_token_log_probs(engine, SOURCES, REFS)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("a,b", [(None, None), (1.0, 2), (0.5, 1), (0.0, 0)])
def test_trained_greedy_identical(tiny, engine, a, b):
    """Also at short limits, where every line ends by its maximum length (limit 0: empty outputs)."""
    model, tok, cfg = tiny
    a = cfg.decode.max_len_a if a is None else a
    b = cfg.decode.max_len_b if b is None else b
    ours = decoding.translate_texts(model, tok, SOURCES, beam=1, max_len_a=a, max_len_b=b)
    found = engine.translate(SOURCES, beam=1, max_len_a=a, max_len_b=b)
    assert [h[0][0] for h in found] == ours
    assert all(ours) if a or b else not any(ours)


@pytest.mark.slow
@pytest.mark.parametrize("beam,alpha", [(2, 0.0), (4, 0.0), (4, 0.6)])
def test_trained_beam_identical(tiny, engine, beam, alpha):
    """The same best translation, except where ours runs to the maximum length (unexplained_differences)."""
    model, tok, cfg = tiny
    opts = dict(beam=beam, len_penalty=alpha, max_len_a=cfg.decode.max_len_a, max_len_b=cfg.decode.max_len_b)
    found = [h[0][0] for h in engine.translate(SOURCES, **opts)]
    assert unexplained_differences(model, tok, SOURCES, found, **opts) == []


@pytest.mark.slow
def test_engine_defaults_empty_lines_and_nbest(tiny, engine):
    """The export's decode defaults (beam 2, len_penalty 0.6), empty lines and n-best lists. Every beam of the
    tiny model runs to the length limit, where CTranslate2 may keep fewer distinct hypotheses than ours (the
    ct2_engine docstring): the best one is still ours, and a short list is filled with ("", -inf) as documented.
    n-best lists of sentences that end before the limit are compared in test_beam_rules_on_many_sentences."""
    model, tok, cfg = tiny
    lines = ["", SOURCES[0], "   ", SOURCES[1]]
    found = engine.translate(lines, nbest=2)
    assert found[0] == found[2] == [("", 0.0)]
    ours = decoding.translate_nbest(model, tok, lines, 2, **{k: getattr(cfg.decode, k) for k in
                                                       ("beam", "len_penalty", "max_len_a", "max_len_b")})
    assert [x[0][0] for x in found] == [x[0][0] for x in ours]
    for hyps in found[1::2]:
        assert len(hyps) == 2 and hyps[0][0] and math.isfinite(hyps[0][1]) and hyps[0][1] >= hyps[1][1]
        assert math.isfinite(hyps[1][1]) or hyps[1] == ("", -math.inf)
    with pytest.raises(UserError, match="nbest"):
        engine.translate(lines, beam=2, nbest=3)


@pytest.mark.slow
def test_int8_export_translates(tiny_run, exported, tmp_path):
    out = export.export_ctranslate2(tiny_run, tmp_path / "int8", quantization="int8")
    assert (out / "model.bin").stat().st_size < 0.6 * (exported / "model.bin").stat().st_size
    assert json.loads((out / ct2_engine.EXPORT_FILE).read_text())["quantization"] == "int8"
    found = ct2_engine.load(out, threads=1).translate(SOURCES, beam=2)
    assert all(h[0][0] and math.isfinite(h[0][1]) for h in found)


@pytest.mark.slow
def test_cli_writes_a_self_contained_folder_and_refuses_to_overwrite(tiny_run, tiny, tmp_path):
    out = tmp_path / "exported"
    args = ("export.py", "--checkpoint", str(tiny_run), "--to", "ctranslate2", str(out))
    proc = run_script(*args, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer", ct2_engine.EXPORT_FILE} <= names
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "tokenizer" / "spm.model").is_file()
    info = json.loads((out / ct2_engine.EXPORT_FILE).read_text())
    _, _, cfg = tiny
    assert info["source_checkpoint"] == str(checkpoint.find_checkpoint(tiny_run).resolve())
    assert info["decode"]["beam"] == cfg.decode.beam and info["decode"]["max_len_b"] == cfg.decode.max_len_b
    assert info["model"]["d_model"] == cfg.model.d_model and info["special_ids"] == dict(pad=0, unk=1, bos=2, eos=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # no temporary folder left
    before = (out / "model.bin").stat().st_mtime_ns
    again = run_script(*args, cwd=ROOT, env=ENV)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {out} exists and is not empty; use --force to replace it"]
    assert (out / "model.bin").stat().st_mtime_ns == before
    forced = run_script(*args, "--force", "--quantization", "int8", cwd=ROOT, env=ENV)
    assert forced.returncode == 0, forced.stderr
    assert json.loads((out / ct2_engine.EXPORT_FILE).read_text())["quantization"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


@pytest.mark.slow
def test_export_folder_needs_no_checkpoint(exported, tmp_path):
    """A copy of the folder alone translates: the tokenizer and the decode defaults travel with it."""
    copy = shutil.copytree(exported, tmp_path / "copy")
    engine = ct2_engine.load(copy, threads=1)
    assert engine.tokenizer.folder.resolve() == (copy / "tokenizer").resolve()
    assert engine.translate(SOURCES[:2]) == ct2_engine.load(exported, threads=1).translate(SOURCES[:2])


# ---------------------------------------------------------------- errors


def test_missing_ctranslate2_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` now raises ImportError
    with pytest.raises(UserError, match=r"^ctranslate2 is not installed: pip install ctranslate2$"):
        ct2_engine.load(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(export.main, ["--checkpoint", str(tmp_path), "--to", "ctranslate2", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: ctranslate2 is not installed: pip install ctranslate2\n"
    assert not (tmp_path / "out").exists()


def test_failed_export_leaves_nothing(tokenizer, tmp_path, monkeypatch):
    run = random_run(tmp_path / "run", tokenizer)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(export, "build_spec", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export.export_ctranslate2(run, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_export_and_load_refuse_bad_paths(tokenizer, tmp_path):
    run = random_run(tmp_path / "run", tokenizer)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is not a folder"):
        export.export_ctranslate2(run, tmp_path / "file")
    with pytest.raises(UserError, match="does not exist"):
        export.export_ctranslate2(run, tmp_path / "missing" / "out")
    with pytest.raises(UserError, match="unknown"):
        export.export_ctranslate2(run, tmp_path / "out", quantization="int3")
    with pytest.raises(UserError, match="holds the checkpoint"):
        export.export_ctranslate2(run, run, force=True)  # --force must not replace the run it reads
    assert (run / "checkpoint_last.pt").is_file()
    with pytest.raises(UserError, match="not an exported model"):
        ct2_engine.load(run)
    (tmp_path / "empty").mkdir()  # an existing empty folder is fine
    assert (export.export_ctranslate2(run, tmp_path / "empty") / "model.bin").is_file()
    with pytest.raises(UserError, match="unknown engine"):
        export.main(["--checkpoint", str(run), "--to", "onnx", str(tmp_path / "x")])


def test_help_lists_the_options():
    proc = run_script("export.py", "--help", cwd=ROOT, env=ENV)
    assert proc.returncode == 0
    for word in ("--checkpoint", "--to", "--quantization", "--force", "ctranslate2", "int8"):
        assert word in proc.stdout
