"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017), section by section.

Attention comes in four variants, chosen by `ModelConfig.attention`: multi-head (mha, §3.2.2), multi-query
(mqa, Shazeer 2019: one shared key/value head), grouped-query (gqa, Ainslie et al. 2023: n_kv_heads key/value
heads shared by groups of query heads) and multi-head latent attention (mla, DeepSeek-V2 2024: keys and values
up-projected from a low-rank latent c_kv, which is what the decoding cache stores).

Legend of dimension letters used in shape comments:
    B batch          S source length     T target (query) length     N key length (S, T, or cache + new)
    D d_model        H query heads       K key/value heads           Dh head dim = D / H
    F d_ff           L MLA kv latent     Lq MLA query latent         V vocabulary size
    Vo output vocabulary (output_vocab "target": the tokens seen as targets in training; else Vo = V)
Masks are boolean with "True = may attend"; a key padding mask (B,S) is True at real tokens.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_KINDS = ("mha", "mqa", "gqa", "mla")
OUTPUT_VOCABS = ("all", "target")
NORMS = ("layer", "scale")


@dataclass
class ModelConfig:
    """Model hyper-parameters; defaults are the base model of Table 3. Plain types only (YAML / asdict)."""

    src_vocab_size: int = 0  # 0 in config files: the trainer fills both from the tokenizer
    tgt_vocab_size: int = 0
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int = 0  # gqa only: key/value heads; 0 = n_heads
    n_enc_layers: int = 6
    n_dec_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # residual and embedding dropout, P_drop of §5.4
    attn_dropout: float = 0.0  # dropout on attention weights (not in the paper; tensor2tensor has it)
    act_dropout: float = 0.0  # dropout on the FFN's ReLU units (not in the paper; fairseq's activation_dropout)
    pad_id: int = 0
    max_positions: int = 1024  # size of the precomputed sinusoid table; longer inputs compute it on the fly
    norm_first: bool = False  # False = the paper's post-norm LayerNorm(x + Sublayer(x)); True = pre-norm
    norm: str = "layer"  # layer = LayerNorm (§3.1) | scale = ScaleNorm g * x / ||x|| (Nguyen & Salazar 2019)
    fix_norm: bool = False  # FixNorm (Nguyen & Chiang 2018): embedding and output rows used at unit length
    qk_norm: float = 0.0  # QKNorm (Henry et al. 2020) when > 0: scores = g cos(q, k), g learned from this value
    share_embeddings: bool = False  # three-way tying of src/tgt embeddings and output (§3.4); joint vocab
    tie_output: bool = True  # tie the target embedding with the pre-softmax projection (§3.4)
    attention: str = "mha"  # mha | mqa | gqa | mla
    kv_latent_dim: int = 0  # mla: size L of the cached latent c_kv; 0 = d_model // 4 (cache 8x below MHA)
    q_latent_dim: int = 0  # mla: size Lq of the query latent; 0 = queries projected directly from x
    output_vocab: str = "all"  # all | target: the softmax covers only the tokens seen as targets in training
    output_size: int = 0  # output_vocab target: how many (the trainer fills it, like the vocabulary sizes)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads K: H for mha, 1 for mqa, n_kv_heads for gqa; mla expands the latent to H heads."""
        if self.attention == "mqa":
            return 1
        if self.attention == "gqa":
            return self.n_kv_heads or self.n_heads
        return self.n_heads

    @property
    def kv_latent(self) -> int:
        """MLA latent size L (0 for the other variants)."""
        if self.attention != "mla":
            return 0
        return self.kv_latent_dim or self.d_model // 4

    def validate(self) -> None:
        """Raise ValueError with one clear line for any impossible combination."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"invalid model config: {msg}")

        need(self.src_vocab_size > 0 and self.tgt_vocab_size > 0, "vocabulary sizes must be positive")
        need(0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size), "pad_id must be a token id")
        need(self.d_model > 0 and self.d_model % 2 == 0, f"d_model={self.d_model} must be positive and even")
        need(self.n_heads > 0 and self.d_model % self.n_heads == 0,
             f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        need(self.attention in ATTENTION_KINDS, f"attention={self.attention!r}, expected {ATTENTION_KINDS}")
        need(self.n_kv_heads >= 0, "n_kv_heads must be >= 0 (0 = n_heads)")
        need(self.n_heads % self.num_kv_heads == 0,
             f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.num_kv_heads}")
        allowed_kv = {"mha": (0, self.n_heads), "mqa": (0, 1), "mla": (0,)}.get(self.attention)
        need(allowed_kv is None or self.n_kv_heads in allowed_kv,
             f"n_kv_heads={self.n_kv_heads} is not for attention={self.attention!r}; use attention='gqa'")
        need(min(self.n_enc_layers, self.n_dec_layers, self.d_ff) > 0, "layer counts and d_ff must be > 0")
        need(all(0.0 <= p < 1.0 for p in (self.dropout, self.attn_dropout, self.act_dropout)),
             f"dropout={self.dropout}, attn_dropout={self.attn_dropout}, act_dropout={self.act_dropout}: "
             "dropout values must be in [0, 1)")
        need(self.max_positions > 0, "max_positions must be > 0")
        need(self.qk_norm >= 0.0, f"qk_norm={self.qk_norm} must be >= 0 (0 = off, else the initial scale g)")
        need(self.kv_latent_dim >= 0 and self.q_latent_dim >= 0, "latent sizes must be >= 0")
        need(self.attention == "mla" or self.kv_latent_dim == self.q_latent_dim == 0,
             "kv_latent_dim / q_latent_dim only apply to attention='mla'")
        need(self.norm in NORMS, f"norm={self.norm!r}, expected {NORMS}")
        need(self.output_vocab in OUTPUT_VOCABS, f"output_vocab={self.output_vocab!r}, expected {OUTPUT_VOCABS}")
        need(0 <= self.output_size <= self.tgt_vocab_size and (self.output_vocab == "target" or not self.output_size),
             f"output_size={self.output_size} must be within the target vocabulary, and 0 unless output_vocab='target'")
        need(not self.share_embeddings or self.src_vocab_size == self.tgt_vocab_size,
             f"share_embeddings needs one joint vocabulary, got src_vocab_size={self.src_vocab_size} "
             f"!= tgt_vocab_size={self.tgt_vocab_size}; set share_embeddings=False or use a joint vocabulary")


# ---------------------------------------------------------------- masks and positions


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Key padding mask (B,S): True at real tokens, which may be attended to."""
    return tokens != pad_id


def causal_mask(t: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """(T, offset+T) mask of §3.2.3: new token i (after `offset` cached ones) sees keys j <= offset + i."""
    return torch.ones(t, offset + t, dtype=torch.bool, device=device).tril(diagonal=offset)


def sinusoid_table(n_positions: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """(N,D) table of §3.5: PE(pos,2i) = sin(pos / 10000^(2i/d_model)), PE(pos,2i+1) = cos(same angle)."""
    pos = torch.arange(n_positions, dtype=torch.float64, device=device)[:, None]  # (N,1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (D/2,) the even indices 2i
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (N,1) / (D/2,) -> (N,D/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class PositionalEncoding(nn.Module):
    """Sinusoidal positions (§3.5): a fixed function, so the table is a non-persistent buffer (not saved)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.register_buffer("table", sinusoid_table(cfg.max_positions, cfg.d_model), persistent=False)

    def forward(self, t: int, offset: int = 0) -> torch.Tensor:
        """Rows offset..offset+t-1 -> (T,D); past the table the sinusoid simply extrapolates."""
        if offset + t <= self.table.size(0):
            return self.table[offset:offset + t]
        return sinusoid_table(offset + t, self.d_model, self.table.device)[offset:].to(self.table.dtype)


# ---------------------------------------------------------------- scaled dot-product attention, two paths


SHORT_KEYS = 64  # on a CPU, attention over at most this many keys runs as plain matmuls (explicit_attention)


def fast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   dropout_p: float) -> torch.Tensor:
    """Eq. (1) softmax(QK^T / sqrt(d_k)) V without the weights: by the fused kernel, or on a CPU with at most
    SHORT_KEYS keys by explicit_attention; q (B,H,T,Dh), k/v (B,K,N,Dh) -> (B,H,T,Dh)."""
    if q.device.type == "cpu" and k.size(-2) <= SHORT_KEYS:
        # The fused CPU kernel blocks over keys; with ~20 of them there is nothing to block and its forward +
        # backward took 2-3x as long as matmul, softmax, matmul (d_head 32, fp32 and bf16, 2-core Zen 4); from
        # ~128 keys the kernel wins.
        return explicit_attention(q, k, v, mask, dropout_p)[0]
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        # The CPU's bf16 fused kernel ran 3x slower than its fp32 one at this model's sizes (d_head 32, ~20
        # tokens; forward+backward, bench/train_real.py profile): attention scores are a small share of the
        # FLOPs, so compute them in fp32 and hand bf16 back.
        with torch.autocast("cpu", enabled=False):  # else autocast casts the fp32 inputs back to bf16
            return fast_attention(q.float(), k.float(), v.float(), mask, dropout_p).to(q.dtype)
    dead = None
    if mask is not None:
        dead = ~mask.any(dim=-1, keepdim=True)  # (..,T,1) queries that see no key: the kernel may give NaN
        if q.device.type == "cpu" and not dead.any():  # the usual case; a GPU would have to sync to know
            dead = None
        else:
            mask = mask | dead  # let them see everything, then zero their output below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         enable_gqa=q.size(1) != k.size(1))
    return out if dead is None else out.masked_fill(dead, 0.0)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (1) as textbooks write it (matmul, scale, mask, softmax, dropout, matmul); also returns the weights.

    Scores and softmax in fp32 (as fused kernels keep them), P·V in the inputs' dtype; fast_attention's path for
    short sequences on a CPU. q (B,H,T,Dh), k/v (B,K,N,Dh) -> (B,H,T,Dh) and weights (B,H,T,N) in fp32."""
    if k.size(1) not in (1, q.size(1)):  # GQA: each group of query heads reads its key/value head
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with torch.autocast(q.device.type, enabled=False):  # else autocast would run the scores' matmul in bf16
        scores = (q.float() * q.size(-1) ** -0.5) @ k.float().transpose(-2, -1)  # (B,H,T,N), MQA broadcasts K=1
        if mask is not None:
            # A finite fill (not -inf): a query that sees no key softmaxes to uniform, not NaN; zeroed below.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        if mask is not None:
            dead = ~mask.any(dim=-1, keepdim=True)  # (..,T,1) queries that see no key get weights 0
            if q.device.type != "cpu" or dead.any():  # on a CPU the usual case skips the op; a GPU would sync
                weights = weights.masked_fill(dead, 0.0)
        out = F.dropout(weights, dropout_p).to(v.dtype) @ v  # (B,H,T,N) @ (B,H,N,Dh) -> (B,H,T,Dh)
    return out, weights


class Attention(nn.Module):
    """MultiHead(Q,K,V) = Concat(head_1..head_H) W^O (§3.2.2); MQA/GQA share K/V heads, MLA uses latents."""

    def __init__(self, cfg: ModelConfig, cross: bool):
        super().__init__()
        self.cross, self.mla = cross, cfg.attention == "mla"
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.num_kv_heads, cfg.head_dim
        self.dropout = cfg.attn_dropout
        d = cfg.d_model
        q_width = cfg.q_latent_dim or d  # MLA may route queries through their own latent c_q
        kv_width = cfg.kv_latent if self.mla else 2 * self.n_kv_heads * self.head_dim
        self.widths = (q_width, kv_width)
        if cross:  # queries come from the decoder, keys and values from the encoder memory
            self.q_proj = nn.Linear(d, q_width)
            self.kv_proj = nn.Linear(d, kv_width)
        else:  # one fused matmul for W^Q, W^K, W^V (or W^Q/W^DQ and the MLA down-projection W^DKV)
            self.qkv_proj = nn.Linear(d, q_width + kv_width)
        self.q_up = nn.Linear(cfg.q_latent_dim, d) if cfg.q_latent_dim else None  # W^UQ (DeepSeek-V2 eq. 12)
        self.kv_up = nn.Linear(cfg.kv_latent, 2 * d) if self.mla else None  # [W^UK; W^UV] fused (eqs. 10-11)
        self.out_proj = nn.Linear(d, d)  # W^O
        # QKNorm's g, one per layer; Henry et al. start it at log2(L^2 - L), L the 97.5th percentile of training
        # lengths (Multi30k's joint BPE 8000: L = 26-29, g = 9.3-9.7).
        self.qk_scale = nn.Parameter(torch.tensor(float(cfg.qk_norm))) if cfg.qk_norm > 0 else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, memory: torch.Tensor | None = None,
                state: dict | None = None, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B,T,D) -> (B,T,D) and weights (B,H,T,N) or None; `state` is this layer's slot of a KVCache."""
        b, t, _ = x.shape
        if self.cross:
            q = self.q_proj(x)  # (B,T,Wq)
            kv = state.get("cross") if state is not None else None
            if kv is None:  # computed once per source sentence, then reused at every decoding step
                kv = self.split_kv(self.kv_proj(memory))
                if state is not None:
                    state["cross"] = kv
        else:
            q, kv_new = self.qkv_proj(x).split(self.widths, dim=-1)  # (B,T,Wq), (B,T,Wkv)
            kv = self.split_kv(kv_new)
            if state is not None:  # append the new positions to the cached ones (time is dim -2 of each)
                if "self" in state:
                    kv = tuple(torch.cat(pair, dim=-2) for pair in zip(state["self"], kv, strict=True))
                state["self"] = kv
        k, v = self.expand_kv(kv)  # (B,K,N,Dh) each
        if self.q_up is not None:
            q = self.q_up(q)  # (B,T,Lq) -> (B,T,D)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B,T,D) -> (B,H,T,Dh)
        if self.qk_scale is not None:  # QKNorm: unit-length heads bound every score by g, so none saturates
            # One multiply per tensor (F.normalize divides, then g would multiply again): the kernels' 1/sqrt(Dh)
            # cancels the sqrt(Dh) here.
            q = q * ((self.qk_scale * self.head_dim ** 0.5) / q.norm(dim=-1, keepdim=True).clamp_min(1e-12))
            k = k * k.norm(dim=-1, keepdim=True).clamp_min(1e-12).reciprocal()
        p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = explicit_attention(q, k, v, mask, p)
        else:
            out, weights = fast_attention(q, k, v, mask, p), None
        out = out.transpose(1, 2).reshape(b, t, -1)  # (B,H,T,Dh) -> (B,T,H*Dh): Concat(head_1..head_H)
        return self.out_proj(out), weights

    def split_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the cache keeps: (K, V) per key/value head; for MLA only the latent c_kv = W^DKV h (eq. 9)."""
        if self.mla:
            return (kv,)  # c_kv (B,N,L)
        b, n, _ = kv.shape
        kv = kv.view(b, n, 2, self.n_kv_heads, self.head_dim)  # (B,N,2*K*Dh) -> (B,N,2,K,Dh)
        k, v = kv.permute(2, 0, 3, 1, 4)  # (B,N,2,K,Dh) -> (2,B,K,N,Dh)
        return k, v

    def expand_kv(self, kv: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA up-projects every head's key and value from the latent (eqs. 10-11); the others are ready."""
        if not self.mla:
            return kv[0], kv[1]
        c = kv[0]  # (B,N,L)
        b, n, _ = c.shape
        kv = self.kv_up(c).view(b, n, 2, self.n_heads, self.head_dim)  # (B,N,L) -> (B,N,2D) -> (B,N,2,H,Dh)
        k, v = kv.permute(2, 0, 3, 1, 4)  # (B,N,2,H,Dh) -> (2,B,H,N,Dh)
        return k, v


class KVCache:
    """Incremental decoding state: self-attention K/V (MLA: c_kv) grow each step; cross K/V stay fixed."""

    def __init__(self, n_layers: int):
        self.layers: list[dict[str, tuple[torch.Tensor, ...]]] = [{} for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Number of target positions already decoded (their keys sit along dim -2)."""
        first = self.layers[0].get("self")
        return 0 if first is None else first[0].size(-2)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (index_select along dim 0) of every cached tensor."""
        for state in self.layers:
            for key, tensors in state.items():
                state[key] = tuple(t.index_select(0, index) for t in tensors)

    def reorder_beams(self, rows: torch.Tensor, kept: torch.Tensor | None) -> None:
        """Beam search: self-attention state follows the beams (rows); the cross K/V, the same for every beam of
        a sentence, only lose the rows of finished sentences (kept: rows left, None when no sentence ended)."""
        for state in self.layers:
            for key, tensors in state.items():
                if key != "cross" or kept is not None:
                    state[key] = tuple(t.index_select(0, rows if key != "cross" else kept) for t in tensors)


# ---------------------------------------------------------------- layers


class FeedForward(nn.Module):
    """Position-wise feed-forward network, FFN(x) = max(0, x W1 + b1) W2 + b2 (eq. 2); act_dropout > 0 drops
    units of the ReLU output in training."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = Dropout(cfg.act_dropout) if cfg.act_dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(F.relu(self.w1(x))))  # (B,T,D) -> (B,T,F) -> (B,T,D)


class Dropout(nn.Dropout):
    """nn.Dropout (§5.4, inverted: kept units scaled by 1/(1-p)), its mask drawn faster on a CPU.

    Why: the CPU generator (mt19937) is serial, ~10 ns a number; bernoulli_ or a torch.rand mask draws one per
    element, 11% of a Multi30k training step (bench/train_real.py, 2 threads). One 64-bit draw gives the 16
    random bits of four elements instead (3.2x faster). The drop probability becomes a multiple of 2^-16,
    round(p * 2^16) / 2^16 (within 8e-6 of p), and kept units are scaled by the inverse of the exact keep
    probability, so the expected output is still x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu":
            return super().forward(x)
        drop = round(self.p * 65536)  # the drop probability in units of 2^-16
        words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)  # 64 bits each
        bits = words.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-2^15, 2^15)
        return x * (bits >= drop - 32768) * (65536 / (65536 - drop))


class ScaleNorm(nn.Module):
    """ScaleNorm(x) = g * x / ||x|| with one learned scalar g, initialised to sqrt(d_model) (Nguyen & Salazar 2019,
    "Transformers without Tears" §2.2): LayerNorm without the mean and the per-feature gain and bias."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(float(d_model) ** 0.5))
        self.d_model, self.eps = d_model, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.g / x.norm(dim=-1, keepdim=True).clamp_min(self.eps))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer the config names (model.norm)."""
    return ScaleNorm(cfg.d_model) if cfg.norm == "scale" else nn.LayerNorm(cfg.d_model)


class Residual(nn.Module):
    """Sub-layer: LayerNorm(x + Dropout(Sublayer(x))) (§3.1, §5.4); pre-norm: x + Dropout(Sublayer(LN(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_first = cfg.norm_first
        self.dropout = Dropout(cfg.dropout)

    def pre(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """The sub-layer input: x itself (post-norm) or LayerNorm(x) (pre-norm)."""
        return norm(x) if self.norm_first else x

    def post(self, x: torch.Tensor, y: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """Add the dropped-out sub-layer output y to the residual stream x; normalise (post-norm only)."""
        x = x + self.dropout(y)
        return x if self.norm_first else norm(x)


class EncoderLayer(Residual):
    """Encoder layer (§3.1): self-attention then feed-forward, each in a residual sub-layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = Attention(cfg, cross=False)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        a, w = self.self_attn(self.pre(x, self.norm1), mask, need_weights=need_weights)
        x = self.post(x, a, self.norm1)
        x = self.post(x, self.ff(self.pre(x, self.norm2)), self.norm2)
        return x, w


class DecoderLayer(Residual):
    """Decoder layer (§3.1): masked self-attention, attention over the encoder output, feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = Attention(cfg, cross=False)
        self.cross_attn = Attention(cfg, cross=True)
        self.ff = FeedForward(cfg)
        self.norm1, self.norm2, self.norm3 = (make_norm(cfg) for _ in range(3))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, self_mask: torch.Tensor | None,
                cross_mask: torch.Tensor, state: dict | None = None,
                need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        a, w_self = self.self_attn(self.pre(x, self.norm1), self_mask, state=state, need_weights=need_weights)
        x = self.post(x, a, self.norm1)
        a, w_cross = self.cross_attn(self.pre(x, self.norm2), cross_mask, memory=memory, state=state,
                                     need_weights=need_weights)
        x = self.post(x, a, self.norm2)
        x = self.post(x, self.ff(self.pre(x, self.norm3)), self.norm3)
        return x, w_self, w_cross


# ---------------------------------------------------------------- the model


class AttentionResult(NamedTuple):
    """What forward_with_attention returns: logits and, per layer, attention weights (rows sum to 1)."""

    logits: torch.Tensor  # (B,T,V)
    enc_self: list[torch.Tensor]  # per encoder layer (B,H,S,S)
    dec_self: list[torch.Tensor]  # per decoder layer (B,H,T,T)
    cross: list[torch.Tensor]  # per decoder layer (B,H,T,S): target position t attending to source position s


class Transformer(nn.Module):
    """Encoder-decoder Transformer (§3, Figure 1): model(src (B,S), tgt_in (B,T)) -> logits (B,T,V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, d, padding_idx=cfg.pad_id)
        self.src_embed = (self.tgt_embed if cfg.share_embeddings
                          else nn.Embedding(cfg.src_vocab_size, d, padding_idx=cfg.pad_id))
        self.positions = PositionalEncoding(cfg)
        self.embed_dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        # Pre-norm leaves the residual stream unnormalised, so each stack ends with one more normalisation.
        self.enc_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.dec_norm = make_norm(cfg) if cfg.norm_first else nn.Identity()
        self.generator = nn.Linear(d, cfg.tgt_vocab_size, bias=False)  # the pre-softmax projection of §3.4
        if cfg.tie_output or cfg.share_embeddings:
            self.generator.weight = self.tgt_embed.weight
        # Why a target-side output vocabulary: a joint BPE vocabulary holds source-language pieces the decoder
        # never emits (a third of Multi30k's 8000 for German targets, half for English), and the V-wide softmax is
        # the model's largest matmul. The ids (Vo,) ascending; set by the trainer, then saved with the weights.
        if cfg.output_vocab == "target" and cfg.output_size < 1:
            raise ValueError("invalid model config: output_vocab='target' needs output_size >= 1 (the trainer sets it)")
        self.register_buffer("output_ids", torch.zeros(cfg.output_size, dtype=torch.long) if cfg.output_size else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections (tensor2tensor, Annotated Transformer); embeddings N(0, d_model^-0.5).

        The embedding scale follows fairseq: after the sqrt(d_model) factor of §3.4 inputs have unit variance,
        the scale of the sinusoid, and a tied output projection starts with logits of order one; Xavier on a
        (V,D) table gives near-zero rows when V >> D. The padding row starts at zero.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        shared = self.src_embed is self.tgt_embed
        embeddings = [self.tgt_embed] if shared else [self.src_embed, self.tgt_embed]
        for emb in embeddings:  # after the Linear loop: a tied generator shares this weight
            nn.init.normal_(emb.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                emb.weight[self.cfg.pad_id].zero_()

    def embed(self, tokens: torch.Tensor, table: nn.Embedding, offset: int = 0) -> torch.Tensor:
        """Embedding * sqrt(d_model) (§3.4) + positional encoding (§3.5), dropout (§5.4): (B,T) -> (B,T,D)."""
        x = table(tokens)  # (B,T,D)
        if self.cfg.fix_norm:  # rare words' rows would otherwise stay short and lose to frequent ones
            x = F.normalize(x, dim=-1)
        x = x * math.sqrt(self.cfg.d_model)
        return self.embed_dropout(x + self.positions(tokens.size(1), offset))

    def _encode(self, src: torch.Tensor, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
        """memory (B,S,D), src_mask (B,S) and per layer the self-attention weights (B,H,S,S) (None: fast path)."""
        src_mask = padding_mask(src, self.cfg.pad_id)  # (B,S) True = real token
        attn_mask = src_mask[:, None, None, :]  # (B,S) -> (B,1,1,S): every query may see every real key
        x = self.embed(src, self.src_embed)
        weights = []
        for layer in self.encoder:
            x, w = layer(x, attn_mask, need_weights)
            weights.append(w)
        return self.enc_norm(x), src_mask, weights

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder stack (§3.1): src (B,S) -> memory (B,S,D) and src_mask (B,S), True = real token."""
        memory, src_mask, _ = self._encode(src, need_weights=False)
        return memory, src_mask

    def _decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: KVCache | None,
                need_weights: bool) -> tuple[torch.Tensor, dict[str, list]]:
        """hidden (B,T,D) and per layer the weights {"dec_self": (B,H,T,T), "cross": (B,H,T,S)} (None: fast)."""
        offset = cache.length if cache is not None else 0
        t = tgt.size(1)
        x = self.embed(tgt, self.tgt_embed, offset)
        self_mask = None if t == 1 else causal_mask(t, tgt.device, offset)  # one new token: sees everything
        cross_mask = src_mask[:, None, None, :]  # (B,S) -> (B,1,1,S)
        weights: dict[str, list] = {"dec_self": [], "cross": []}
        for i, layer in enumerate(self.decoder):
            state = cache.layers[i] if cache is not None else None
            x, w_self, w_cross = layer(x, memory, self_mask, cross_mask, state, need_weights)
            weights["dec_self"].append(w_self)
            weights["cross"].append(w_cross)
        return self.dec_norm(x), weights

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
               cache: KVCache | None = None) -> torch.Tensor:
        """Decoder stack (§3.1): tgt (B,T) -> hidden (B,T,D); with a cache, tgt holds only the new tokens.

        Target padding needs no mask: pads come after the real tokens, and causality already hides later keys.
        For beam search, reorder src_mask (and memory) together with `cache.reorder(index)`.
        """
        return self._decode(tgt, memory, src_mask, cache, need_weights=False)[0]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B,T,V) of the next token at every target position (teacher forcing).

        keep (B,T), True at the N positions that need logits, gives logits (N,V) instead: the V-wide output
        projection, the largest matmul, is not spent on padding."""
        return self.logits(self.features(src, tgt_in, keep))  # (B,T,D) -> (B,T,V), or (N,D) -> (N,V)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The pre-softmax projection of §3.4: (...,D) -> (...,V); tokens outside the output vocabulary get -inf."""
        z = F.linear(h, self.output_weight())  # (...,Vo)
        if self.output_ids is None:
            return z
        full = z.new_full((*z.shape[:-1], self.cfg.tgt_vocab_size), float("-inf"))  # (...,V)
        return full.index_copy(-1, self.output_ids, z)

    def output_weight(self) -> torch.Tensor:
        """The projection's rows for the output vocabulary: (V,D), or (Vo,D) with output_vocab 'target'.

        Under FixNorm each row has unit length, so a logit is |h| cos(h, w): the final norm's gain sets the radius r.
        """
        w = self.generator.weight  # (V,D)
        w = w if self.output_ids is None else w.index_select(0, self.output_ids)
        return F.normalize(w, dim=-1) if self.cfg.fix_norm else w

    def output_rows(self, tokens: torch.Tensor, unk_id: int) -> torch.Tensor:
        """Target token ids -> their rows in output_weight() (the same ids with output_vocab 'all'). A token the
        model cannot emit counts as unk, as in a word vocabulary: validation text, or a fine-tuning corpus."""
        if self.output_ids is None:
            return tokens
        ids = self.output_ids  # (Vo,) ascending
        rows = torch.searchsorted(ids, tokens).clamp_(max=ids.numel() - 1)
        unk_row = torch.searchsorted(ids, torch.tensor(unk_id, device=ids.device))
        return torch.where(ids[rows] == tokens, rows, unk_row)

    def features(self, src: torch.Tensor, tgt_in: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's output (B,T,D), the input of the pre-softmax projection; with keep (B,T), its (N,D) rows
        where keep is True (training fuses the projection into its loss: loss.projected_label_smoothed_nll)."""
        memory, src_mask = self.encode(src)
        h = self.decode(tgt_in, memory, src_mask)  # (B,T,D)
        return h if keep is None else h[keep]  # (B,T,D)[keep] -> (N,D)

    def forward_with_attention(self, src: torch.Tensor, tgt_in: torch.Tensor) -> "AttentionResult":
        """forward() through the textbook path of eq. (1) (explicit_attention), keeping every attention weight."""
        memory, src_mask, enc_weights = self._encode(src, need_weights=True)
        h, weights = self._decode(tgt_in, memory, src_mask, None, need_weights=True)
        return AttentionResult(self.logits(h), enc_weights, weights["dec_self"], weights["cross"])

    def new_cache(self) -> KVCache:
        """An empty cache for incremental decoding with `decode(new_tokens, memory, src_mask, cache)`."""
        return KVCache(len(self.decoder))


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_elem: int = 2) -> int:
    """Decoder self-attention cache bytes per generated token, all layers: 2*K*Dh per layer, or L for MLA."""
    per_layer = cfg.kv_latent if cfg.attention == "mla" else 2 * cfg.num_kv_heads * cfg.head_dim
    return per_layer * cfg.n_dec_layers * bytes_per_elem


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once), to compare with Table 3."""
    return sum(p.numel() for p in model.parameters())
