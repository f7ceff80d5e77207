"""Tests of transformer_model.py: the paper's equations, the two attention paths, the cache, the variants."""

import math
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import transformer_model as tm
from transformer_model import (
    Attention,
    Dropout,
    ModelConfig,
    PositionalEncoding,
    Transformer,
    causal_mask,
    count_parameters,
    kv_cache_bytes_per_token,
    padding_mask,
    sinusoid_table,
)

VARIANTS = ["mha", "mqa", "gqa", "mla"]
SRC_V, TGT_V = 23, 19


def tiny_cfg(attention: str = "mha", **overrides) -> ModelConfig:
    """A 2+2 layer model with d_model 16 and 4 heads; gqa uses 2 kv heads, mla both latents."""
    extra = {"gqa": {"n_kv_heads": 2}, "mla": {"kv_latent_dim": 8, "q_latent_dim": 12}}.get(attention, {})
    fields = dict(src_vocab_size=SRC_V, tgt_vocab_size=TGT_V, d_model=16, n_heads=4, n_enc_layers=2,
                  n_dec_layers=2, d_ff=32, dropout=0.0, attention=attention, **extra)
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(attention: str = "mha", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_cfg(attention, **overrides)).eval()


def tokens(b: int, n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    """Random non-pad token ids (B,N)."""
    return torch.randint(1, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    return torch.allclose(a, b, atol=atol, rtol=0)


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_keep_rate_scale_and_mean(p):
    """Inverted dropout: a kept unit is x / keep probability, a dropped one 0; the keep rate is 1-p (within
    2^-16 and sampling noise) and the mean is preserved."""
    torch.manual_seed(0)
    drop = Dropout(p).train()
    x = torch.full((1000, 513), 2.0)  # an odd size: the last 64-bit draw is only partly used
    y = drop(x)
    keep = 1.0 - round(p * 65536) / 65536
    assert abs(keep - (1 - p)) < 2**-16
    values = torch.unique(y).tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(2.0 / keep, rel=1e-6)
    rate = y.ne(0).float().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.numel())
    assert abs(y.mean().item() - 2.0) < 0.01


def test_dropout_mask_is_random_per_call_seeded_and_uncorrelated():
    """Fresh masks each call, the same masks after re-seeding (exact resume restores the generator), and the
    four elements that share one 64-bit draw are independent (no lane is biased)."""
    drop = Dropout(0.5).train()
    x = torch.ones(4000, 64)
    torch.manual_seed(3)
    a, b = drop(x), drop(x)
    torch.manual_seed(3)
    assert torch.equal(drop(x), a) and not torch.equal(a, b)
    lanes = a.ne(0).float().view(-1, 4)  # elements 4i..4i+3 come from draw i
    assert torch.allclose(lanes.mean(0), torch.full((4,), 0.5), atol=0.01)
    corr = torch.corrcoef(lanes.T - 0.5)
    assert (corr - torch.eye(4)).abs().max() < 0.02


def test_dropout_gradient_eval_mode_and_dtype():
    drop = Dropout(0.3).train()
    x = torch.randn(37, 29, dtype=torch.bfloat16, requires_grad=True)
    y = drop(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    kept = y.ne(0) | x.eq(0)
    assert torch.equal(x.grad.ne(0), kept)  # the gradient flows through kept units only, times the scale
    scale = 1.0 / (1.0 - round(0.3 * 65536) / 65536)
    assert torch.allclose(x.grad[kept].float(), torch.full_like(x.grad[kept].float(), scale), rtol=1e-2)
    drop.eval()
    assert torch.equal(drop(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)


# ---------------------------------------------------------------- positions


def test_sinusoid_table_matches_formula():
    d = 16
    table = sinusoid_table(60, d)
    for pos in (0, 1, 7, 59):
        for i in (0, 1, 3, 7):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_positions_beyond_max_positions_extrapolate():
    cfg = tiny_cfg(max_positions=4)
    pe = PositionalEncoding(cfg)
    assert "table" not in pe.state_dict()  # a fixed function of position: not saved in checkpoints
    assert close(pe(6, offset=3), sinusoid_table(9, cfg.d_model)[3:], atol=1e-6)
    model = tiny_model(max_positions=4)
    assert "positions.table" not in model.state_dict()
    logits = model(tokens(2, 7, SRC_V), tokens(2, 9, TGT_V))
    assert logits.shape == (2, 9, TGT_V) and torch.isfinite(logits).all()


def test_embedding_is_scaled_then_positions_added():
    model = tiny_model()
    src = tokens(2, 5, SRC_V)
    expected = model.src_embed(src) * math.sqrt(16) + sinusoid_table(5, 16)  # §3.4 scale, §3.5 sum
    assert close(model.embed(src, model.src_embed), expected, atol=1e-6)
    assert close(model.embed(src, model.src_embed, offset=3)[:, 0], expected[:, 0] - sinusoid_table(4, 16)[0]
                 + sinusoid_table(4, 16)[3], atol=1e-5)


# ---------------------------------------------------------------- attention module


def module_inputs(cross: bool, mask_kind: str):
    torch.manual_seed(3)
    x, memory = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    n = 7 if cross else 5
    if mask_kind == "padding":
        lengths = torch.tensor([n, 2, 4])
        mask = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :]  # (B,1,1,N)
    elif mask_kind == "causal":
        mask = torch.ones(5, n, dtype=torch.bool).tril()
    else:
        mask = None
    return x, memory, mask


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal"])
def test_fast_path_equals_explicit_path_module(variant, cross, mask_kind):
    torch.manual_seed(0)
    attn = Attention(tiny_cfg(variant), cross=cross).eval()
    x, memory, mask = module_inputs(cross, mask_kind)
    fast, no_weights = attn(x, mask, memory=memory)
    explicit, weights = attn(x, mask, memory=memory, need_weights=True)
    assert no_weights is None and weights.shape == (3, 4, 5, 7 if cross else 5)
    assert close(fast, explicit)
    assert close(weights.sum(-1), torch.ones(3, 4, 5))
    if mask is not None:
        assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("norm_first", [False, True])
def test_fast_path_equals_explicit_path_model(variant, norm_first):
    model = tiny_model(variant, norm_first=norm_first)
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    src[1, 3:] = 0
    fast = model(src, tgt)
    result = model.forward_with_attention(src, tgt)
    assert close(fast, result.logits)
    assert [w.shape for w in result.enc_self] == [(2, 4, 6, 6)] * 2
    assert [w.shape for w in result.dec_self] == [(2, 4, 5, 5)] * 2
    assert [w.shape for w in result.cross] == [(2, 4, 5, 6)] * 2
    assert (result.cross[0][1, :, :, 3:] == 0).all()  # padded source keys get no attention
    assert (result.dec_self[0].triu(diagonal=1) == 0).all()  # no attention to the future


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", ["padding", "causal"])
def test_explicit_attention_equals_the_fused_kernel(dtype, kv_heads, mask_kind):
    """fast_attention takes explicit_attention up to SHORT_KEYS keys on a CPU and the fused kernel beyond: on the
    same inputs both give the same output and gradients, a query that sees no key included (output 0)."""
    n, t = tm.SHORT_KEYS + 6, 9
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, t, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, n, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    if mask_kind == "padding":
        mask = (torch.arange(n)[None, :] < torch.tensor([n, 5, 0])[:, None])[:, None, None, :]  # row 3: no key
    else:
        mask = torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)
    outs, grads = [], []
    for attend in (tm.fast_attention, lambda *args: tm.explicit_attention(*args)[0]):
        out = attend(q, k, v, mask, 0.0)
        assert out.dtype == dtype
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(outs[0], outs[1], atol=tol, rtol=tol)
    assert all(torch.allclose(a.float(), b.float(), atol=tol * 10, rtol=tol) for a, b in zip(*grads, strict=True))
    if mask_kind == "padding":
        assert (outs[1][2] == 0).all() and (grads[1][0][2] == 0).all()


def test_matches_torch_multihead_attention():
    torch.manual_seed(0)
    ours = Attention(tiny_cfg("mha"), cross=False).eval()
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv_proj.weight)  # both stack [W^Q; W^K; W^V] with heads contiguous
        ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(2, 5, 16)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])  # (B,S) True = real token
    ref_out, ref_w = ref(x, x, x, key_padding_mask=~keep, average_attn_weights=True)  # torch: True = ignore
    out, w = ours(x, keep[:, None, None, :], need_weights=True)
    fast, _ = ours(x, keep[:, None, None, :])
    assert close(out, ref_out) and close(fast, ref_out)
    assert close(w.mean(dim=1), ref_w)


@pytest.mark.parametrize("variant", VARIANTS)
def test_unmasked_attention_permutation_properties(variant):
    torch.manual_seed(0)
    cross = Attention(tiny_cfg(variant), cross=True).eval()
    self_attn = Attention(tiny_cfg(variant), cross=False).eval()
    x, memory, _ = module_inputs(True, "none")
    perm_q, perm_k = torch.randperm(5), torch.randperm(7)
    out, _ = cross(x, None, memory=memory)
    assert close(cross(x[:, perm_q], None, memory=memory)[0], out[:, perm_q])  # queries permute the output
    assert close(cross(x, None, memory=memory[:, perm_k])[0], out)  # key/value pairs: a set, order irrelevant
    assert close(self_attn(x[:, perm_q], None)[0], self_attn(x, None)[0][:, perm_q])


def test_mask_helpers():
    assert padding_mask(torch.tensor([[5, 3, 0, 0]]), 0).tolist() == [[True, True, False, False]]
    assert causal_mask(2, torch.device("cpu"), offset=1).tolist() == [[True, True, False], [True, True, True]]


# ---------------------------------------------------------------- model properties


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    model = tiny_model(variant)
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 6, TGT_V, seed=2)
    logits = model(src, tgt)
    for j in range(1, 6):
        changed = tgt.clone()
        changed[:, j] = changed[:, j] % (TGT_V - 1) + 1  # another non-pad token
        new = model(src, changed)
        assert close(new[:, :j], logits[:, :j])
        assert not close(new[:, j], logits[:, j])  # the change is visible where it should be


@pytest.mark.parametrize("variant", VARIANTS)
def test_appended_padding_changes_nothing(variant):
    model = tiny_model(variant)
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    logits = model(src, tgt)
    pad_src = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    pad_tgt = torch.cat([tgt, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    assert close(model(pad_src, tgt), logits)
    assert close(model(src, pad_tgt)[:, :5], logits)
    assert close(model.forward_with_attention(pad_src, pad_tgt).logits[:, :5], logits)
    short = model(src[1:, :4], tgt[1:, :3])  # a shorter sentence alone vs padded inside a batch
    src[1, 4:], tgt[1, 3:] = 0, 0
    assert close(model(src, tgt)[1:, :3], short)


def test_logits_at_kept_positions_only():
    """forward(keep=mask) returns the (N,V) rows of the full (B,T,V) logits where mask is True, in order."""
    model = tiny_model()
    src, tgt = tokens(3, 6, SRC_V), tokens(3, 5, TGT_V, seed=2)
    tgt[1, 2:], tgt[2, 4:] = 0, 0
    keep = tgt.ne(0)
    kept = model(src, tgt, keep=keep)
    assert kept.shape == (int(keep.sum()), TGT_V)
    assert close(kept, model(src, tgt)[keep])


@pytest.mark.parametrize("variant,norm", [*((v, "layer") for v in VARIANTS), ("mha", "scale"), ("mha", "fix"),
                                          ("mha", "qk"), ("mla", "qk")])
def test_cached_decoding_equals_full_pass_and_beam_reorder(variant, norm):
    kind = {"fix": dict(fix_norm=True, norm_first=True), "scale": dict(norm="scale", norm_first=True),
            "qk": dict(qk_norm=3.0)}
    model = tiny_model(variant, max_positions=5, **kind.get(norm, {}))  # max_positions: past the table too
    src, tgt = tokens(3, 6, SRC_V), tokens(3, 7, TGT_V, seed=2)
    src[2, 4:] = 0
    memory, src_mask = model.encode(src)
    full = model.logits(model.decode(tgt, memory, src_mask))
    cache = model.new_cache()
    steps = [model.logits(model.decode(tgt[:, :2], memory, src_mask, cache))]  # a 2-token prefix first
    for i in range(2, 4):
        steps.append(model.logits(model.decode(tgt[:, i:i + 1], memory, src_mask, cache)))
    assert cache.length == 4
    assert close(torch.cat(steps, dim=1), full[:, :4])
    index = torch.tensor([2, 0, 0])  # beam search keeps hypotheses 2, 0 and 0 again
    cache.reorder(index)
    memory, src_mask = memory[index], src_mask[index]
    tgt2 = torch.cat([tgt[index, :4], tgt[:, 4:]], dim=1)
    full2 = model.logits(model.decode(tgt2, memory, src_mask))
    for i in range(4, 7):
        step = model.logits(model.decode(tgt2[:, i:i + 1], memory, src_mask, cache))
        assert close(step[:, 0], full2[:, i])
    assert cache.length == 7


def test_scale_norm_is_g_times_the_unit_vector_and_replaces_every_layer_norm():
    norm = tm.ScaleNorm(16)
    x = torch.randn(3, 5, 16) * 7
    y = norm(x)
    assert close(y.norm(dim=-1), torch.full((3, 5), 4.0))  # g starts at sqrt(d_model)
    assert close(y, x * 4.0 / x.norm(dim=-1, keepdim=True))
    assert close(norm(torch.zeros(2, 16)), torch.zeros(2, 16))  # the clamp keeps a zero row finite
    model = tiny_model(norm="scale", norm_first=True)
    kinds = {type(m) for m in model.modules()}
    assert tm.ScaleNorm in kinds and torch.nn.LayerNorm not in kinds
    assert sum(isinstance(m, tm.ScaleNorm) for m in model.modules()) == 2 * 2 + 2 * 3 + 2  # layers + final norms
    layer = tiny_model(norm_first=True)
    assert count_parameters(layer) - count_parameters(model) == (2 * 2 + 2 * 3 + 2) * (2 * 16 - 1)
    model.train()
    model(tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)).logsumexp(-1).sum().backward()
    assert all(m.g.grad is not None and m.g.grad.abs() > 0 for m in model.modules() if isinstance(m, tm.ScaleNorm))


def test_qk_norm_scores_are_g_times_the_cosine_so_query_and_key_lengths_change_nothing():
    """QKNorm (Henry et al. 2020): per head, softmax(g cos(q, k)) V; rescaling W^Q and W^K rows changes nothing."""
    src, tgt = tokens(3, 6, SRC_V), tokens(3, 5, TGT_V, seed=2)
    for g in (2.5, 0.0):
        model = tiny_model(qk_norm=g)
        before = model(src, tgt)
        with torch.no_grad():  # each head's query and key rows by their own factor
            for attn in (m for m in model.modules() if isinstance(m, Attention)):
                factor = (torch.rand(4, 1) * 5 + 0.2).repeat_interleave(4, 0)  # (H*Dh, 1)
                keys = (attn.kv_proj, 0) if attn.cross else (attn.qkv_proj, 16)  # K rows follow Q's in qkv_proj
                for proj, first in ((attn.q_proj if attn.cross else attn.qkv_proj, 0), keys):
                    proj.weight[first:first + 16].mul_(factor)
                    proj.bias[first:first + 16].mul_(factor[:, 0])
        assert close(model(src, tgt), before, atol=1e-4) == (g > 0)
    attn = tiny_model(qk_norm=2.5).encoder[0].self_attn
    x = torch.randn(2, 5, 16)
    q, k, v = (t.view(2, 5, 4, 4).transpose(1, 2) for t in attn.qkv_proj(x).split(16, dim=-1))
    cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)  # (B,H,T,T)
    expected = attn.out_proj((2.5 * cos).softmax(-1).matmul(v).transpose(1, 2).reshape(2, 5, 16))
    assert close(attn(x, None)[0], expected)
    model = tiny_model(qk_norm=2.5).train()
    model(src, tgt).logsumexp(-1).sum().backward()
    scales = [m.qk_scale for m in model.modules() if isinstance(m, Attention)]
    assert len(scales) == 2 + 2 * 2 and all(g.grad is not None and g.grad.abs() > 0 for g in scales)
    with pytest.raises(ValueError, match="qk_norm"):
        tiny_cfg(qk_norm=-1.0).validate()


def test_fix_norm_uses_unit_rows_so_a_row_s_length_changes_nothing():
    """FixNorm (Nguyen & Chiang 2018): the embedding and the output projection see each row at unit length."""
    src, tgt = tokens(3, 6, SRC_V), tokens(3, 5, TGT_V, seed=2)
    for fix in (True, False):
        model = tiny_model(fix_norm=fix, norm_first=True)
        before = model(src, tgt)
        with torch.no_grad():  # every row its own length, in both tables (the target one is the output's too)
            model.src_embed.weight.mul_(torch.rand(SRC_V, 1) * 3 + 0.2)
            model.tgt_embed.weight.mul_(torch.rand(TGT_V, 1) * 3 + 0.2)
        assert close(model(src, tgt), before, atol=1e-4) == fix
    model = tiny_model(fix_norm=True, norm_first=True, output_vocab="target", output_size=9)
    model.output_ids.copy_(torch.arange(1, 10))
    assert close(model.output_weight().norm(dim=-1), torch.ones(9))
    model.train()
    model(src, tgt).log_softmax(-1)[..., 1:10].sum().backward()
    w, g = model.tgt_embed.weight, model.tgt_embed.weight.grad  # a unit row's gradient is orthogonal to the row
    assert g.abs().sum() > 0 and close((w * g).sum(-1), torch.zeros(TGT_V))


# ---------------------------------------------------------------- variants and cache size


@pytest.mark.parametrize("kv_heads,other", [(4, "mha"), (1, "mqa")])
def test_gqa_extremes_are_mha_and_mqa(kv_heads, other):
    gqa = tiny_model("gqa", n_kv_heads=kv_heads)
    ref = tiny_model(other, seed=1)
    gqa.load_state_dict(ref.state_dict())  # same parameter shapes, so the same weights fit
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    assert close(gqa(src, tgt), ref(src, tgt))
    assert kv_cache_bytes_per_token(gqa.cfg) == kv_cache_bytes_per_token(ref.cfg)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_heads(kv_heads):
    """Query head h reads kv head h // (H/K): copying each kv head into its group gives an equal MHA."""
    torch.manual_seed(0)
    dh, group = 4, 4 // kv_heads
    gqa = Attention(tiny_cfg("gqa", n_kv_heads=kv_heads), cross=False).eval()
    mha = Attention(tiny_cfg("mha"), cross=False).eval()

    def expand(t):  # rows [Q (16); K (K*Dh); V (K*Dh)] -> [Q; K repeated per group; V repeated per group]
        q, k, v = t.split([16, kv_heads * dh, kv_heads * dh])
        grow = lambda m: m.reshape(kv_heads, dh, *m.shape[1:]).repeat_interleave(group, 0).flatten(0, 1)  # noqa: E731
        return torch.cat([q, grow(k), grow(v)])

    with torch.no_grad():
        mha.qkv_proj.weight.copy_(expand(gqa.qkv_proj.weight))
        mha.qkv_proj.bias.copy_(expand(gqa.qkv_proj.bias))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x, _, mask = module_inputs(False, "causal")
    assert close(gqa(x, mask)[0], mha(x, mask)[0])


def test_cache_bytes_per_token_scale():
    mha = tiny_cfg("mha", n_heads=8, d_model=64)
    for kv_heads in (1, 2, 4, 8):
        gqa = tiny_cfg("gqa", n_heads=8, d_model=64, n_kv_heads=kv_heads)
        assert kv_cache_bytes_per_token(gqa) * 8 == kv_cache_bytes_per_token(mha) * kv_heads
    mqa = tiny_cfg("mqa", n_heads=8, d_model=64)
    assert kv_cache_bytes_per_token(mqa) * 8 == kv_cache_bytes_per_token(mha)
    assert kv_cache_bytes_per_token(mha, bytes_per_elem=4) == 2 * 64 * 2 * 4
    assert kv_cache_bytes_per_token(tiny_cfg("mla")) == 8 * 2 * 2  # kv_latent_dim numbers per layer
    assert ModelConfig(10, 10, attention="mla").kv_latent == 128  # default d_model // 4


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_tensors_match_reported_bytes(variant):
    model = tiny_model(variant)
    cfg, (b, s, t) = model.cfg, (2, 6, 3)
    memory, src_mask = model.encode(tokens(b, s, SRC_V))
    cache = model.new_cache()
    model.decode(tokens(b, t, TGT_V), memory, src_mask, cache)
    numel = 0
    for state in cache.layers:
        if variant == "mla":  # only the latents are kept, for self- and cross-attention alike
            assert [x.shape for x in state["self"]] == [(b, t, cfg.kv_latent_dim)]
            assert [x.shape for x in state["cross"]] == [(b, s, cfg.kv_latent_dim)]
        else:
            assert [x.shape for x in state["self"]] == [(b, cfg.num_kv_heads, t, cfg.head_dim)] * 2
            assert [x.shape for x in state["cross"]] == [(b, cfg.num_kv_heads, s, cfg.head_dim)] * 2
        numel += sum(x.numel() for x in state["self"])
    assert numel * 2 // (b * t) == kv_cache_bytes_per_token(cfg, bytes_per_elem=2)


@pytest.mark.parametrize("size,low,high", [((512, 8, 2048), 62e6, 66e6), ((1024, 16, 4096), 210e6, 216e6)])
def test_parameter_count_matches_table3(size, low, high):
    d, h, ff = size
    cfg = ModelConfig(37000, 37000, d_model=d, n_heads=h, d_ff=ff, share_embeddings=True)
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = Transformer(cfg)
    assert low <= count_parameters(model) <= high
    with torch.device("meta"):
        untied = Transformer(ModelConfig(37000, 37000, d_model=d, n_heads=h, d_ff=ff, tie_output=False))
    assert count_parameters(untied) - count_parameters(model) == 2 * 37000 * d


def test_tying_and_init():
    shared = tiny_model(share_embeddings=True, src_vocab_size=TGT_V)
    assert shared.src_embed.weight is shared.tgt_embed.weight is shared.generator.weight
    model = tiny_model(d_model=64, src_vocab_size=3000)
    assert model.generator.weight is model.tgt_embed.weight and model.src_embed is not model.tgt_embed
    assert (model.src_embed.weight[0] == 0).all() and (model.tgt_embed.weight[0] == 0).all()
    assert model.src_embed.weight[1:].std().item() == pytest.approx(64 ** -0.5, rel=0.05)
    untied = tiny_model(tie_output=False)
    assert untied.generator.weight is not untied.tgt_embed.weight


# ---------------------------------------------------------------- robustness


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_padding_source_row_gives_no_nan(variant):
    model = tiny_model(variant, dropout=0.1).train()
    src, tgt = tokens(2, 5, SRC_V), tokens(2, 4, TGT_V, seed=2)
    src[1] = 0
    for explicit in (False, True):
        logits = model.forward_with_attention(src, tgt).logits if explicit else model(src, tgt)
        assert torch.isfinite(logits).all()
        F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    attn = Attention(tiny_cfg(variant), cross=True).eval()
    x, memory, mask = module_inputs(True, "padding")
    mask = mask.clone()
    mask[1] = False
    for need_weights in (False, True):
        assert (attn(x, mask, memory=memory, need_weights=need_weights)[0][1] == attn.out_proj.bias).all()


@pytest.mark.parametrize("bad,message", [
    (dict(d_model=18), "divisible by n_heads"),
    (dict(d_model=15, n_heads=5), "even"),
    (dict(attention="gqa", n_kv_heads=3), "divisible by n_kv_heads"),
    (dict(attention="mha", n_kv_heads=2), "use attention='gqa'"),
    (dict(dropout=-0.1), "dropout"),
    (dict(attn_dropout=1.0), "dropout"),
    (dict(act_dropout=-0.5), "dropout"),
    (dict(attention="flash"), "expected"),
    (dict(share_embeddings=True), "joint vocabulary"),
    (dict(kv_latent_dim=8), "only apply to attention='mla'"),
    (dict(pad_id=19), "pad_id"),
    (dict(n_dec_layers=0), "layer counts"),
    (dict(norm="rms"), "norm='rms', expected"),
])
def test_validate_rejects_impossible_configs(bad, message):
    cfg = tiny_cfg(**bad)
    with pytest.raises(ValueError, match=message):
        cfg.validate()
    with pytest.raises(ValueError, match=message):
        Transformer(cfg)


def test_act_dropout_drops_ffn_units_in_training_only():
    plain = tiny_model()
    dropped = tiny_model(act_dropout=0.5)
    dropped.load_state_dict(plain.state_dict())  # the option adds no parameters
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    h = torch.randn(2, 5, 16)
    ff = dropped.decoder[0].ff
    with torch.no_grad():
        assert torch.equal(dropped(src, tgt), plain(src, tgt))  # eval: no dropout
        hidden = F.relu(ff.w1(h))
        kept = ff.train().dropout(hidden)
    zeroed = (kept == 0) & (hidden != 0)
    assert 0.3 < zeroed.float().sum() / (hidden != 0).float().sum() < 0.7  # about half the live units
    assert torch.allclose(kept[kept != 0], 2 * hidden[kept != 0])  # kept units scaled by 1 / (1 - p)
    dropped.train()
    assert not torch.equal(dropped(src, tgt), plain(src, tgt))


def test_config_round_trips_as_plain_dict():
    cfg = tiny_cfg("mla")
    d = asdict(cfg)
    assert all(isinstance(v, int | float | bool | str) for v in d.values())
    assert ModelConfig(**d) == cfg
    cfg.validate()


@pytest.mark.parametrize("variant", VARIANTS)
def test_autocast_bf16_forward_backward(variant):
    model = tiny_model(variant, dropout=0.1, attn_dropout=0.1).train()
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    src[1, 4:] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
        weighted = model.forward_with_attention(src, tgt).logits
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(weighted).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        memory, src_mask = model.encode(src)
        cache = model.new_cache()
        for i in range(3):
            h = model.decode(tgt[:, i:i + 1], memory, src_mask, cache)
            assert torch.isfinite(model.generator(h)).all()


@pytest.mark.slow
def test_torch_compile_matches_eager():
    model = tiny_model("gqa")
    src, tgt = tokens(2, 6, SRC_V), tokens(2, 5, TGT_V, seed=2)
    src[1, 4:] = 0
    assert close(torch.compile(model)(src, tgt), model(src, tgt), atol=1e-4)
