"""Training: schedule and loss against their formulas, end-to-end runs, exact resume, DDP equivalence."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from checkpoint import average_checkpoints, read_checkpoint
from config import TrainConfig, load_config
from evaluation import selection_bleu, weight_average
from loss import ROWS_PER_PASS, TranslationLoss, label_smoothed_nll, projected_label_smoothed_nll, projected_rdrop_loss
from runtime import UserError
from train_transformer import WeightAverage, build_optimizer, cooldown_factor, learning_rate
from transformer_model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[1]


def run_train(args, cwd=ROOT, check=True, timeout=300, env=None):
    """Run the trainer in a subprocess, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "train_transformer.py", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}")
    return proc


def tiny_args(tmp_path, *extra):
    return ["--config", "configs/tiny.yaml", f"train.out_dir={tmp_path / 'run'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *extra]


# -- formulas -------------------------------------------------------------------------------------------------


def test_learning_rate_matches_eq3():
    d, w = 512, 4000
    assert learning_rate(1, d, w) == pytest.approx(d**-0.5 * 1 * w**-1.5)
    assert learning_rate(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)  # the peak: both branches meet
    assert learning_rate(4 * w, d, w) == pytest.approx(d**-0.5 * (4 * w) ** -0.5)
    assert learning_rate(4 * w, d, w, factor=2.0) == pytest.approx(2 * d**-0.5 * (4 * w) ** -0.5)
    assert learning_rate(w - 1, d, w) < learning_rate(w, d, w) > learning_rate(w + 1, d, w)


def test_cooldown_factor():
    assert cooldown_factor(0.99, 0.0) == 1.0  # off: the paper's schedule untouched
    assert cooldown_factor(0.5, 0.3) == 1.0  # before the last 30%
    assert cooldown_factor(0.85, 0.3) == pytest.approx(0.5)
    assert cooldown_factor(1.0, 0.3) == 0.0 and cooldown_factor(1.2, 0.3) == 0.0


def test_cooldown_in_the_trainer(tmp_path):
    """train.cooldown scales eq. 3 by the remaining fraction of max_steps over its last part."""
    run_train(tiny_args(tmp_path, "train.max_steps=30", "train.eval_every=15", "train.cooldown=0.5",
                        "train.average_last=0"))
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    d, w, f = cfg["model"]["d_model"], cfg["train"]["warmup"], cfg["train"]["lr_factor"]
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    # the lr of step s is set before it, when (s - 1) of 30 steps are done
    assert lrs[15] == pytest.approx(learning_rate(15, d, w, f))
    assert lrs[30] == pytest.approx(learning_rate(30, d, w, f) * (1 - 29 / 30) / 0.5)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_weight_decay_is_decoupled_and_spares_gains_and_biases(weight_decay):
    """AdamW (Loshchilov & Hutter 2019): with a zero gradient a step shrinks each weight matrix and the embedding
    table by exactly lr * weight_decay and leaves gains and biases alone; L2 in the gradient (Adam's coupled
    weight_decay) would instead move every weight, 1-D ones included, by about lr."""
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32))
    optimizer = build_optimizer(model, TrainConfig(weight_decay=weight_decay))
    for group in optimizer.param_groups:
        group["lr"] = 0.01
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shapes = {p.dim() >= 2 for p in model.parameters()}
    assert shapes == {True, False}
    for name, p in model.named_parameters():
        factor = 1 - 0.01 * weight_decay if p.dim() >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)


def test_weight_average_is_the_exponential_moving_average_of_the_updates():
    """ema_t = d_t * ema_(t-1) + (1 - d_t) * w_t with d_t = min(decay, (1 + t) / (10 + t)), written out."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=20, tgt_vocab_size=20, d_model=8, n_heads=2, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=16, share_embeddings=True))
    ema = WeightAverage(model, decay=0.5)
    expected = [p.detach().clone() for p in model.parameters()]
    buffers = {k: v.clone() for k, v in ema.model.named_buffers()}
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        d = min(0.5, (1 + step) / (10 + step))
        assert ema.decay_at(step) == d
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, model.parameters(), strict=True)]
        ema.update(model, step)
    for e, a in zip(expected, ema.model.parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
        assert not a.requires_grad
    for k, v in ema.model.named_buffers():  # the positional table and other buffers are not averaged
        assert torch.equal(v, buffers[k]), k
    assert ema.decay_at(100) == 0.5 and ema.decay_at(1) == pytest.approx(2 / 11)


def test_label_smoothing_closed_form():
    """Model puts p on the target and (1-p)/(V-1) elsewhere: the loss has a closed form."""
    V, eps, p = 7, 0.1, 0.6
    probs = torch.full((1, 1, V), (1 - p) / (V - 1))
    probs[0, 0, 3] = p
    target = torch.tensor([[3]])
    loss, nll = label_smoothed_nll(probs.log(), target, eps, pad_id=0)
    expected = -(1 - eps) * math.log(p) - eps / V * (math.log(p) + (V - 1) * math.log((1 - p) / (V - 1)))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(-math.log(p), rel=1e-6)
    logits = torch.randn(2, 5, V)
    tgt = torch.randint(1, V, (2, 5))
    tgt[1, 3:] = 0  # padding is ignored
    ours, _ = label_smoothed_nll(logits, tgt, eps, pad_id=0)
    ref = F.cross_entropy(logits.view(-1, V), tgt.view(-1), ignore_index=0, label_smoothing=eps, reduction="sum")
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_gradient_matches_autograd(eps):
    """The closed-form backward equals autograd through log_softmax, for the loss and the NLL outputs, in
    float64 so that the comparison is tight; gradcheck also checks it against finite differences."""
    V = 11
    logits = torch.randn(3, 4, V, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(1, V, (3, 4))
    tgt[2, 2:] = 0
    w_loss, w_nll = 0.7, -1.3  # weights on the two outputs, so that both backward paths are exercised
    loss, nll = label_smoothed_nll(logits, tgt, eps, pad_id=0)
    ours = torch.autograd.grad(w_loss * loss + w_nll * nll, logits)[0]
    logp = F.log_softmax(logits, dim=-1)
    keep = tgt.ne(0)
    ref_nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    ref_loss = ((1 - eps) * ref_nll - eps * logp.mean(-1)) * keep
    ref = torch.autograd.grad(w_loss * ref_loss.sum() + w_nll * (ref_nll * keep).sum(), logits)[0]
    assert torch.allclose(ours, ref, rtol=0, atol=1e-12)
    assert ours[2, 2:].abs().max() == 0  # padding gets no gradient
    assert torch.autograd.gradcheck(lambda z: label_smoothed_nll(z, tgt, eps, 0), (logits,))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_projected_loss_equals_loss_of_the_logits(eps, transposed, monkeypatch):
    """The fused projection + loss (what the trainer runs) gives label_smoothed_nll(hidden @ W.T) and its
    gradients, over more rows than one block, with the weight gradient in either operand order (the CPU picks
    one); gradcheck in float64; a second backward through a retained graph (the first one turned the kept softmax
    into the gradient in place) gives the same gradients again."""
    monkeypatch.setattr("loss.TRANSPOSED_WEIGHT_GRAD", transposed)
    n, d, v = 2 * ROWS_PER_PASS + 5, 6, 13
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(1, v, (n,))
    loss, nll = projected_label_smoothed_nll(hidden, weight, tgt, eps)
    ref_loss, ref_nll = label_smoothed_nll(hidden @ weight.t(), tgt, eps, pad_id=0)
    torch.testing.assert_close((loss, nll), (ref_loss, ref_nll))
    ours = torch.autograd.grad(0.7 * loss - 1.3 * nll, (hidden, weight), retain_graph=True)
    ref = torch.autograd.grad(0.7 * ref_loss - 1.3 * ref_nll, (hidden, weight))
    again = torch.autograd.grad(0.7 * loss - 1.3 * nll, (hidden, weight))
    for a, b, c in zip(ours, ref, again, strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(c, b)
    small = (hidden[:7].detach().requires_grad_(), weight.detach().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: projected_label_smoothed_nll(h, w, tgt[:7], eps), small)


def test_translation_loss_equals_the_model_logits_path():
    """TranslationLoss (fused output projection, what DDP wraps) gives the loss and parameter gradients of
    model(src, tgt_in, keep) followed by label_smoothed_nll, in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32, dropout=0.0, share_embeddings=True))
    src, tgt_in, tgt_out = (torch.randint(1, 23, (3, n)) for n in (6, 5, 5))
    src[0, 4:], tgt_in[1, 3:], tgt_out[1, 2:] = 0, 0, 0
    keep = tgt_out.ne(0)
    assert_fused_equals_plain(
        model, lambda: TranslationLoss(model, 0.1, pad_id=0, unk_id=1)(src, tgt_in, tgt_out),
        lambda: label_smoothed_nll(model(src, tgt_in, keep=keep), tgt_out[keep], 0.1, pad_id=0))


def assert_fused_equals_plain(model, fused, plain) -> list[list[torch.Tensor]]:
    """fused() and plain() -> (loss, NLL) agree, and so do their parameter gradients (fp32), in fp32 and under bf16
    autocast; returns fused()'s gradients of each precision."""
    out = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        runs = []
        for f in (plain, fused):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss, nll = f()
            loss.backward()
            runs.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
        (loss_a, nll_a, grads_a), (loss_b, nll_b, grads_b) = runs
        torch.testing.assert_close((loss_b, nll_b), (loss_a, nll_a), rtol=tol, atol=tol)
        for a, b in zip(grads_a, grads_b, strict=True):
            assert b.dtype == torch.float32
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)
        out.append(grads_b)
    return out


def rdrop_reference(hidden, weight, target, eps, alpha):
    """R-Drop's objective by plain autograd: label smoothing on both copies' logits, and the symmetric KL of
    their log_softmax, as fairseq's criterion computes it (F.kl_div both ways, halved), all divided by 2."""
    logits = (hidden @ weight.t()).float()  # (2N,V)
    loss, nll = label_smoothed_nll(logits, torch.cat([target, target]), eps, pad_id=-1)
    lp1, lp2 = F.log_softmax(logits, -1).chunk(2)
    kl = (F.kl_div(lp1, lp2, log_target=True, reduction="sum") + F.kl_div(lp2, lp1, log_target=True,
                                                                         reduction="sum")) / 2
    return (loss + alpha * kl) / 2, nll / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rdrop_loss_equals_plain_autograd(dtype):
    """The closed-form R-Drop loss (fused projection, KL gradient by hand) gives the value and the gradients of
    hidden and weight of the autograd reference, in fp32 and under bf16 autocast; and gradcheck in fp64."""
    torch.manual_seed(0)
    n, d, v, eps, alpha = ROWS_PER_PASS + 5, 8, 30, 0.1, 5.0
    hidden, weight = torch.randn(2 * n, d) * 2, torch.randn(v, d)
    target = torch.randint(0, v, (n,))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    runs = []
    for f in (rdrop_reference, projected_rdrop_loss):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, nll = f(h, w, target, eps, alpha)
        loss.backward()
        runs.append((loss.detach(), nll.detach(), h.grad, w.grad))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol * max(1.0, float(a.abs().max())))
    kl = (runs[0][0] - label_smoothed_nll(hidden @ weight.t(), torch.cat([target, target]), eps, -1)[0] / 2)
    assert kl > 1.0  # two different halves: the KL term is really in the comparison
    small = (hidden[:6].double().requires_grad_(), weight.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda h, w: projected_rdrop_loss(h, w, target[:3], eps, alpha), small)


def test_translation_loss_rdrop_runs_the_batch_twice():
    """TranslationLoss with rdrop_alpha: without dropout both copies agree, the KL and its gradient are 0 and the
    loss is the plain one; with dropout the two masks differ and the KL adds to the loss; in eval mode it is the
    plain loss."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32, dropout=0.0, share_embeddings=True))
    src, tgt_in, tgt_out = (torch.randint(1, 23, (3, n)) for n in (6, 5, 5))
    src[0, 4:], tgt_in[1, 3:], tgt_out[1, 2:] = 0, 0, 0
    plain, rdrop = (TranslationLoss(model, 0.1, pad_id=0, unk_id=1, rdrop_alpha=a) for a in (0.0, 5.0))
    assert_fused_equals_plain(model, lambda: rdrop(src, tgt_in, tgt_out), lambda: plain(src, tgt_in, tgt_out))
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    torch.manual_seed(1)
    with_kl = rdrop(src, tgt_in, tgt_out)[0]
    torch.manual_seed(1)
    without = TranslationLoss(model, 0.1, pad_id=0, unk_id=1, rdrop_alpha=1e-9)(src, tgt_in, tgt_out)[0]
    assert with_kl > without + 1e-3
    model.eval()
    torch.testing.assert_close(rdrop(src, tgt_in, tgt_out), plain(src, tgt_in, tgt_out))


def test_rdrop_end_to_end(tmp_path):
    """train.rdrop_alpha through the script: the run trains, its logged training NLL stays per target token (the
    trainer divides R-Drop's halved sums by the batch's tokens, not twice them), and it evaluates and reports."""
    run_train(tiny_args(tmp_path, "train.rdrop_alpha=5", "train.max_steps=20", "train.eval_every=10"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vocab = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["tgt_vocab_size"]
    assert rows[-1]["step"] == 20 and 0 < rows[0]["train_loss"] < 1.5 * math.log(vocab)
    assert math.isfinite(json.loads((tmp_path / "run" / "results.json").read_text())["tests"]["val"]["bleu"])


def test_translation_loss_under_torch_compile():
    """train.compile wraps TranslationLoss: compiled, it gives eager's loss and gradients on batches of different
    target-token counts, and the fused loss stays out of the graph (torch.compiler.disable): traced, its loop over
    blocks of rows made one graph per count, each compiled from scratch."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32, dropout=0.0, share_embeddings=True))
    objective = TranslationLoss(model, 0.1, pad_id=0, unk_id=1)
    compiled = torch.compile(objective)
    for n in (5, 7, ROWS_PER_PASS + 3):  # a third shape: dynamic shapes, not one graph per batch
        src, tgt_in, tgt_out = (torch.randint(1, 23, (3, n)) for _ in range(3))
        tgt_out[1, n - 2:] = 0
        runs = []
        for f in (objective, compiled):
            model.zero_grad()
            loss, nll = f(src, tgt_in, tgt_out)
            loss.backward()
            runs.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(runs[1][:2], runs[0][:2], rtol=1e-5, atol=1e-5)
        for a, b in zip(runs[0][2], runs[1][2], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    explained = torch._dynamo.explain(objective)(src, tgt_in, tgt_out)
    traced = [g.print_readable(print_output=False) for g in explained.graphs]  # with their subgraphs
    assert traced and not any("amax" in code for code in traced)  # amax: the loss's row maxima


def test_loss_on_kept_logits_equals_loss_on_padded_logits():
    """The trainer's step (logits at real target tokens only) gives the loss and gradients of the plain one."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32, dropout=0.0, share_embeddings=True))
    src, tgt_in, tgt_out = (torch.randint(1, 23, (3, n)) for n in (6, 5, 5))
    src[0, 4:], tgt_in[1, 3:], tgt_out[1, 2:] = 0, 0, 0
    runs = []
    for keep in (None, tgt_out.ne(0)):
        model.zero_grad()
        logits = model(src, tgt_in) if keep is None else model(src, tgt_in, keep=keep)
        loss, nll = label_smoothed_nll(logits, tgt_out if keep is None else tgt_out[keep], 0.1, pad_id=0)
        loss.backward()
        runs.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, nll_a, grads_a), (loss_b, nll_b, grads_b) = runs
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(nll_a, nll_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_label_smoothing_optimum_is_smoothed_target():
    """Minimising the smoothed loss drives the target probability to 1 - eps + eps/V, not to 1."""
    V, eps = 5, 0.2
    logits = torch.zeros(1, 1, V, requires_grad=True)
    opt = torch.optim.LBFGS([logits], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = label_smoothed_nll(logits, torch.tensor([[2]]), eps, pad_id=0)[0]
        loss.backward()
        return loss

    opt.step(closure)
    assert logits.softmax(-1)[0, 0, 2].item() == pytest.approx(1 - eps + eps / V, abs=1e-4)


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="unknown key 'train.lr'"):
        load_config("configs/tiny.yaml", ["train.lr=1"])
    with pytest.raises(UserError, match="train.max_steps: expected int"):
        load_config("configs/tiny.yaml", ["train.max_steps=abc"])
    with pytest.raises(UserError, match="warmup"):
        load_config("configs/tiny.yaml", ["train.warmup=0"])
    with pytest.raises(UserError, match="pad_multiple"):
        load_config("configs/tiny.yaml", ["train.pad_multiple=0"])
    with pytest.raises(UserError, match=r"train.ema_decay must be in \[0, 1\)"):
        load_config("configs/tiny.yaml", ["train.ema_decay=1.0"])
    cfg = load_config("configs/tiny.yaml", ["train.max_steps=7", "model.dropout=0.25"])
    assert cfg.train.max_steps == 7 and cfg.model.dropout == 0.25


# -- end to end -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path):
    proc = run_train(tiny_args(tmp_path))
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert set(results["tests"]) == {"val", "test"}
    for scores in results["tests"].values():
        assert {"bleu", "chrf", "bleu_tok_lc", "signature"} <= set(scores)
    assert "sacreBLEU signature" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "curves.png", "checkpoint_last.pt", "checkpoint_best.pt"):
        assert (run / name).exists(), name
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [15, 30]
    state = torch.load(run / "checkpoint_last.pt", weights_only=True)  # plain tensors and values only
    assert state["step"] == 30 and state["config"]["train"]["max_steps"] == 30
    assert len(list(run.glob("checkpoint_step*.pt"))) == 2  # keep_last
    # the run dir alone is enough to translate
    out = subprocess.run([sys.executable, "translate.py", "--checkpoint", str(run), "a man is riding a bike ."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1
    # a second run into the same folder is refused unless resumed or overwritten
    again = run_train(tiny_args(tmp_path), check=False)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "Traceback" not in again.stderr


def test_lowercase_run_writes_lowercase_and_picks_checkpoints_on_lowercased_bleu(tmp_path):
    """data.lowercase: every hypothesis is lowercase, and the BLEU that picks checkpoints (at each evaluation and
    in the final report) is the tokenized lowercased one, which a lowercase model can score on."""
    cfg = load_config("configs/tiny.yaml")
    scores = {"bleu": 10.0, "bleu_tok_lc": 30.0}
    assert selection_bleu(scores, cfg) == 10.0
    cfg.data.lowercase = True
    assert selection_bleu(scores, cfg) == 30.0
    proc = run_train(tiny_args(tmp_path, "data.lowercase=true", "train.eval_bleu_sentences=0"))
    run = tmp_path / "run"
    hyps = (run / "hyps" / "val.de").read_text("utf-8").splitlines()
    assert hyps and any(h.strip() for h in hyps) and all(h == h.lower() for h in hyps)
    assert "validation BLEU (greedy, tokenized lowercased)" in proc.stderr
    results = json.loads((run / "results.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert results["val_bleu_greedy"]["best"] == max(m["val_bleu"] for m in metrics)  # both on the whole split
    out = subprocess.run([sys.executable, "translate.py", "--checkpoint", str(run / "checkpoint_best.pt"),
                          "--reference", "val", "--beam", "1", "--json", "--output", str(tmp_path / "val.de")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    greedy = json.loads(out.stdout)  # the best checkpoint's greedy scores, as a user gets them
    assert results["val_bleu_greedy"]["best"] == greedy["bleu_tok_lc"] != greedy["bleu"]


def test_weight_average_is_a_final_model_candidate(tmp_path):
    """train.ema_decay: its validation loss at each evaluation, then one more candidate of the final report; the
    file translate.py prefers is the winner's, and --report rebuilds the same choice from checkpoint_last.pt."""
    run_train(tiny_args(tmp_path, "train.ema_decay=0.9"))
    run = tmp_path / "run"
    assert all("ema_val_loss" in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    last = read_checkpoint(run / "checkpoint_last.pt")
    assert last["ema"].keys() == last["model"].keys()
    assert not torch.equal(last["ema"]["src_embed.weight"], last["model"]["src_embed.weight"])  # averaged
    results = json.loads((run / "results.json").read_text())
    assert set(results["val_bleu_greedy"]) == {"best", "avg2", "ema"}
    kept = {name: (run / f"checkpoint_{name}.pt").exists() for name in ("avg", "ema")}
    assert kept == {"avg": results["model"] == "avg2", "ema": results["model"] == "ema"}
    run_train(["--report", str(run)])  # deletes neither candidate for good: both are rebuilt and judged again
    again = json.loads((run / "results.json").read_text())
    assert again["val_bleu_greedy"] == results["val_bleu_greedy"] and again["model"] == results["model"]
    candidate = weight_average(run / "checkpoint_last.pt")  # what checkpoint_ema.pt holds when it wins
    assert candidate.keys() == {"model", "config", "step", "tokenizer_sha256"} and candidate["step"] == 30
    assert all(torch.equal(v, last["ema"][k]) for k, v in candidate["model"].items())


def test_weight_average_changes_nothing_the_model_learns(tmp_path):
    """The average only reads the weights: the same run with and without it ends with the same weights and
    optimizer state, bit for bit (dropout draws the same random numbers)."""
    common = ["train.max_steps=15", "train.eval_every=15", "train.average_last=0"]
    run_train(tiny_args(tmp_path / "plain", *common))
    run_train(tiny_args(tmp_path / "ema", *common, "train.ema_decay=0.9"))
    a = read_checkpoint(tmp_path / "plain" / "run" / "checkpoint_last.pt")
    b = read_checkpoint(tmp_path / "ema" / "run" / "checkpoint_last.pt")
    assert "ema" not in a and "ema" in b
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
    for i, state in a["optimizer"]["state"].items():
        for name, value in state.items():  # step, exp_avg, exp_avg_sq
            torch.testing.assert_close(value, b["optimizer"]["state"][i][name], rtol=0, atol=0, msg=name)


def test_weight_average_can_start_when_a_run_is_resumed(tmp_path):
    """A run started without train.ema_decay and resumed with it averages from the resumed step on."""
    run_train(tiny_args(tmp_path, "train.max_steps=15"))
    proc = run_train(tiny_args(tmp_path, "train.resume=true", "train.ema_decay=0.9"))
    assert "holds no weight average (train.ema_decay was 0): it starts at step 15" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("ema_val_loss" in r) for r in rows] == [False, True]
    assert "ema" in json.loads((tmp_path / "run" / "results.json").read_text())["val_bleu_greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("bpe_dropout,weight_decay,ema", [("0.0", "0.0", "0.0"), ("0.1", "0.0", "0.0"),
                                                        ("0.0", "0.1", "0.9")])
def test_resume_equals_uninterrupted(tmp_path, bpe_dropout, weight_decay, ema):
    # pad_multiple 1, the CPU recipes' setting: the resumed run must rebuild the same batch boundaries; with
    # BPE-dropout (and the target output vocabulary it widens) also the same segmentation of its epoch
    common = ["train.precision=fp32", "train.eval_every=1000", "train.average_last=0", "train.pad_multiple=1",
              f"train.bpe_dropout={bpe_dropout}", f"train.weight_decay={weight_decay}", f"train.ema_decay={ema}",
              "model.output_vocab=target"]
    run_train(tiny_args(tmp_path / "a", *common, "train.max_steps=24"))
    run_train(tiny_args(tmp_path / "b", *common, "train.max_steps=11"))
    run_train(tiny_args(tmp_path / "b", *common, "train.max_steps=24", "train.resume=true"))
    a = read_checkpoint(tmp_path / "a" / "run" / "checkpoint_last.pt")
    b = read_checkpoint(tmp_path / "b" / "run" / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 24
    assert (a["epoch"], a["batch_in_epoch"]) == (b["epoch"], b["batch_in_epoch"])
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
    assert ("ema" in a) == ("ema" in b) == (ema != "0.0")
    for k in a.get("ema", {}):  # the weight average goes on from where it was, too
        torch.testing.assert_close(a["ema"][k], b["ema"][k], rtol=0, atol=0, msg=k)
    first = a["optimizer"]["state"][0]["exp_avg_sq"]
    torch.testing.assert_close(first, b["optimizer"]["state"][0]["exp_avg_sq"], rtol=0, atol=0)


@pytest.mark.slow
def test_ddp_two_processes_equal_one_with_update_freq(tmp_path):
    """Two gloo ranks each take every other batch; one process with update_freq=2 takes both in turn.

    adam_eps is raised for the comparison only: some gradients are exactly zero in exact arithmetic (the key
    bias cannot change a softmax), and Adam with eps 1e-9 divides their float round-off by itself, turning
    1e-12 noise into full-size steps that differ between any two summation orders."""
    common = ["train.precision=fp32", "model.dropout=0.0", "model.attn_dropout=0.0", "train.max_steps=6",
              "train.adam_eps=1e-4",
              "train.eval_every=1000", "train.average_last=0", "train.max_tokens=256"]
    run_train(tiny_args(tmp_path / "one", *common, "train.update_freq=2"))
    env = {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train_transformer.py", *tiny_args(tmp_path / "two", *common)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = read_checkpoint(tmp_path / "one" / "run" / "checkpoint_last.pt")["model"]
    two = read_checkpoint(tmp_path / "two" / "run" / "checkpoint_last.pt")["model"]
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-4, atol=1e-5, msg=k)


def test_average_checkpoints(tmp_path):
    for i, value in enumerate([1.0, 2.0, 6.0]):
        torch.save({"model": {"w": torch.full((2,), value)}, "config": {}, "step": i}, tmp_path / f"c{i}.pt")
    avg = average_checkpoints([tmp_path / f"c{i}.pt" for i in range(3)])
    assert torch.equal(avg["model"]["w"], torch.full((2,), 3.0)) and avg["step"] == 2


def test_average_keeps_integer_buffers(tmp_path):
    """The output vocabulary's ids (an integer buffer) are kept as they are, and must agree, not be averaged."""
    for i, (value, ids) in enumerate([(1.0, [1, 3]), (2.0, [1, 3]), (3.0, [1, 4])]):
        torch.save({"model": {"w": torch.full((2,), value), "output_ids": torch.tensor(ids)}, "config": {}, "step": i},
                   tmp_path / f"c{i}.pt")
    avg = average_checkpoints([tmp_path / "c0.pt", tmp_path / "c1.pt"])
    assert avg["model"]["output_ids"].dtype == torch.int64 and avg["model"]["output_ids"].tolist() == [1, 3]
    assert torch.equal(avg["model"]["w"], torch.full((2,), 1.5))
    with pytest.raises(UserError, match="output_ids differs"):
        average_checkpoints([tmp_path / f"c{i}.pt" for i in range(3)])


def test_average_keeps_the_tokenizer_fingerprint(tmp_path):
    """translate.py checks a run's tokenizer/ against the checkpoint's fingerprint: the average must carry it,
    and checkpoints of two tokenizers are not averaged."""
    for i, sha in enumerate(["aa", "aa", "bb"]):
        torch.save({"model": {"w": torch.ones(2)}, "config": {}, "step": i, "tokenizer_sha256": sha},
                   tmp_path / f"c{i}.pt")
    assert average_checkpoints([tmp_path / "c0.pt", tmp_path / "c1.pt"])["tokenizer_sha256"] == "aa"
    with pytest.raises(UserError, match="another tokenizer"):
        average_checkpoints([tmp_path / f"c{i}.pt" for i in range(3)])


# -- a model that must learn ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_learns_to_copy(tmp_path):
    """Copying random symbol strings reaches >= 95% exact match in 800 small steps: catches wrong masks and
    shifted targets (a decoder that may peek at the next token, or a target off by one, never gets there)."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(12)]
    for split, n in (("train", 10000), ("val", 100), ("test", 100)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]
        for lang in ("en", "de"):
            (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    args = ["--config", "configs/tiny.yaml", f"train.out_dir={tmp_path / 'run'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", f"data.train_prefix={tmp_path / 'train'}",
            f"data.valid_prefix={tmp_path / 'val'}", f"data.test_prefixes=[{tmp_path / 'test'}]",
            "data.tokenizer=spacy", "data.min_freq=1", "model.share_embeddings=false", "model.d_model=64",
            "model.n_heads=4", "model.d_ff=128", "model.n_enc_layers=2", "model.n_dec_layers=2", "model.dropout=0.0",
            "model.norm_first=true", "train.max_steps=800", "train.eval_every=200", "train.warmup=100",
            "train.lr_factor=0.5", "train.max_tokens=1024", "train.precision=fp32", "decode.beam=1",
            "decode.max_len_b=20"]
    run_train(args)
    hyps = (tmp_path / "run" / "hyps" / "test.de").read_text().splitlines()
    refs = (tmp_path / "test.de").read_text().splitlines()
    exact = sum(h.split() == r.split() for h, r in zip(hyps, refs, strict=True)) / len(refs)
    assert exact >= 0.95, exact


# -- the target-side output vocabulary (model.output_vocab: target) ---------------------------------------------


def target_vocab_model() -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1,
                                    n_dec_layers=1, d_ff=32, dropout=0.0, share_embeddings=True,
                                    output_vocab="target", output_size=9))
    ids = torch.tensor([1, 3, 5, 6, 8, 11, 13, 17, 20])  # unk (1) and eos (3) among them, as the trainer makes it
    model.output_ids.copy_(ids)
    return model, ids


def test_target_output_vocabulary_logits_and_rows():
    """model() gives the projection onto the output vocabulary at its tokens and -inf at every other; a target
    token outside it maps to unk's row."""
    model, ids = target_vocab_model()
    src, tgt_in = torch.randint(1, 23, (2, 6)), torch.randint(1, 23, (2, 5))
    logits = model(src, tgt_in)  # (B,T,V)
    h = model.features(src, tgt_in)  # (B,T,D)
    torch.testing.assert_close(logits[..., ids], h @ model.generator.weight[ids].t())
    outside = torch.ones(23, dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.isneginf(logits[..., outside]).all()
    rows = model.output_rows(torch.tensor([1, 3, 20, 4, 0, 22]), unk_id=1)
    assert rows.tolist() == [0, 1, 8, 0, 0, 0]  # 4, 0 and 22 are not in ids: unk's row 0
    with pytest.raises(ValueError, match="output_size"):
        Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, output_vocab="target"))
    with pytest.raises(ValueError, match="output_vocab"):
        ModelConfig(src_vocab_size=23, tgt_vocab_size=23, output_vocab="source").validate()


def test_target_output_vocabulary_loss_equals_plain_autograd():
    """TranslationLoss over the output vocabulary: the loss and gradients of plain label smoothing on the logits of
    its tokens, the targets as their rows (one outside it counted as unk), in fp32 and under bf16 autocast."""
    model, ids = target_vocab_model()
    src, tgt_in = torch.randint(1, 23, (3, 6)), torch.randint(1, 23, (3, 5))
    tgt_out = ids[torch.randint(0, 9, (3, 5))]
    tgt_out[1, 2:], tgt_out[0, 0] = 0, 4  # padding, and a token the model cannot emit
    keep = tgt_out.ne(0)
    rows = torch.tensor([int((ids == t).nonzero()) if t in ids else 0 for t in tgt_out[keep].tolist()])
    grads = assert_fused_equals_plain(
        model, lambda: TranslationLoss(model, 0.1, pad_id=0, unk_id=1)(src, tgt_in, tgt_out),
        lambda: label_smoothed_nll(model.features(src, tgt_in, keep) @ model.generator.weight[ids].t(), rows, 0.1,
                                   pad_id=-1))  # logits (N,Vo) of the output vocabulary
    used = torch.cat([ids, src.flatten(), tgt_in.flatten()])  # rows of the tied table this batch touches
    for g in grads:
        assert not g[0][torch.ones(23, dtype=torch.bool).index_fill_(0, used, False)].any()


def test_target_output_vocabulary_end_to_end(tmp_path):
    """model.output_vocab=target: the output ids are the training targets' tokens plus eos and unk, saved with the
    weights; the run evaluates, averages, reports, resumes with the same ids, and translate.py decodes it."""
    import data_preparation as dp

    run_train(tiny_args(tmp_path, "model.output_vocab=target", "train.max_steps=20"))
    run = tmp_path / "run"
    first = read_checkpoint(run / "checkpoint_last.pt")
    prepared = next(p for p in (tmp_path / "prepared").iterdir() if p.is_dir())
    targets = set(dp.load_split(prepared, "train").tgt_tokens.tolist()) | {dp.EOS_ID, dp.UNK_ID}
    assert first["model"]["output_ids"].tolist() == sorted(targets)
    assert first["config"]["model"]["output_size"] == len(targets) < first["config"]["model"]["tgt_vocab_size"]
    results = json.loads((run / "results.json").read_text())
    assert math.isfinite(results["tests"]["val"]["bleu"]) and results["model"] in ("best", "avg2")
    run_train(tiny_args(tmp_path, "model.output_vocab=target", "train.max_steps=30", "train.resume=true"))
    resumed = read_checkpoint(run / "checkpoint_last.pt")
    assert resumed["step"] == 30 and torch.equal(resumed["model"]["output_ids"], first["model"]["output_ids"])
    assert all(math.isfinite(json.loads(line)["val_loss"]) for line in (run / "metrics.jsonl").read_text().splitlines())
    out = subprocess.run([sys.executable, "translate.py", "--checkpoint", str(run), "a man is riding a bike ."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1, out.stderr
    # fine-tuned on other text (the fixture's test split), the model keeps the output vocabulary it was trained with
    tuned = tmp_path / "tuned"
    tune = ["--config", "configs/tiny.yaml", f"train.out_dir={tuned}", f"data.prepared_dir={tmp_path / 'prep2'}",
            "data.train_prefix=tests/fixtures/test", "data.test_prefixes=[]", "model.output_vocab=target",
            f"train.init_from={run}",
            "train.max_steps=4", "train.eval_every=2"]
    run_train(tune)
    tuned_ids = read_checkpoint(tuned / "checkpoint_last.pt")["model"]["output_ids"]
    assert torch.equal(tuned_ids, first["model"]["output_ids"])
    run_train(["--config", str(tuned / "config.yaml"), "--resume", "train.max_steps=6"])  # ids from its checkpoint
    assert read_checkpoint(tuned / "checkpoint_last.pt")["step"] == 6


# -- train_ensemble.py ----------------------------------------------------------------------------------------


def run_ensemble(tmp_path, *extra):
    args = [sys.executable, "train_ensemble.py", "--config", "configs/tiny.yaml", "--out-dir", str(tmp_path / "ens"),
            f"data.prepared_dir={tmp_path / 'prepared'}", *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NMT_DEBUG": "0", "PYTHONUNBUFFERED": "1"})


def test_train_ensemble_trains_seeded_members_at_once_and_scores_their_mean(tmp_path):
    import data_preparation as dp
    from scoring import score
    from translator import Translator

    proc = run_ensemble(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "ens"
    result = json.loads((out / "results.json").read_text("utf-8"))
    assert result["threads_per_member"] == max(1, (os.cpu_count() or 1) // 2)
    assert set(result["tests"]) == {"val", "test"} == set(result["member_tests"]["seed1"])
    seeds = [yaml.safe_load((out / f"seed{k}" / "config.yaml").read_text("utf-8"))["train"]["seed"] for k in (1, 2)]
    assert seeds == [1, 2] and "seed2: step 30/30, val loss" in proc.stdout
    members = [result["member_tests"][f"seed{k}"]["test"]["bleu"] for k in (1, 2)]
    # the reported score is the mean-probability ensemble's (what translate.py --checkpoint A --checkpoint B gives)
    prepared = dp.prepare(load_config("configs/tiny.yaml", [f"data.prepared_dir={tmp_path / 'prepared'}"]).data)
    ensemble = Translator.load_ensemble([out / "seed1", out / "seed2"], device="cpu")
    hyps = [t.text for t in ensemble.translate(dp.read_raw(prepared, "test", "en"))]
    assert result["tests"]["test"] == score(hyps, dp.read_raw(prepared, "test", "de"), "de")
    assert result["tests"]["test"]["bleu"] not in members or members[0] == members[1]
    # the closing table gives both scorings (a data.lowercase run is judged on the second), ensemble first
    lines = proc.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("split ") and "ensemble" in line):]
    row = next(line for line in table if line.startswith("test "))
    cells = [result["tests"]["test"]] + [result["member_tests"][f"seed{k}"]["test"] for k in (1, 2)]
    assert row.split()[1:] == [x for c in cells for x in (f"{c['bleu']:.2f}", "/", f"{c['bleu_tok_lc']:.2f}")]
    stamp = (out / "seed1" / "checkpoint_last.pt").stat().st_mtime_ns
    again = run_ensemble(tmp_path)  # finished members are not trained again
    assert again.returncode == 0 and again.stdout.count("not trained again") == 2
    assert (out / "seed1" / "checkpoint_last.pt").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text("utf-8"))["tests"] == result["tests"]
    (out / "seed1" / "results.json").unlink()  # killed after its last checkpoint: resumed there
    for path in (out / "seed2").glob("checkpoint*.pt"):  # killed before its first checkpoint: started over
        path.unlink()
    (out / "seed2" / "results.json").unlink()
    again = run_ensemble(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "writing the final report from its checkpoints" in (out / "seed1.log").read_text("utf-8")
    assert "not trained again" not in again.stdout
    assert "final report from its checkpoints" not in (out / "seed2.log").read_text("utf-8")
    assert json.loads((out / "results.json").read_text("utf-8"))["tests"] == result["tests"]


@pytest.mark.parametrize("extra, message", [
    (["--members", "1"], "--members must be at least 2"),
    (["train.seed=3"], "train.seed and train.out_dir are set per member"),
    (["train.init_from=/nonexistent"], "failed (exit 2): error: train.init_from: checkpoint not found"),
])
def test_train_ensemble_errors_are_one_line(tmp_path, extra, message):
    proc = run_ensemble(tmp_path, *extra)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
