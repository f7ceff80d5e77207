"""Export a trained checkpoint to a self-contained CTranslate2 model folder (fast CPU/GPU inference).

    python export.py --checkpoint runs/multi30k_en_de --to ctranslate2 exported/en_de_int8 --quantization int8

The folder holds CTranslate2's model.bin, config.json and vocabularies, a copy of our tokenizer/ and
nmt_export.json (source checkpoint, decode defaults, model and data config, special ids): ct2_engine.load(folder)
translates from it without the checkpoint.

How our model maps onto ctranslate2.specs.TransformerSpec (the mapping is exact, weights are copied as they are):
- embeddings are scaled by sqrt(d_model) (scale_embeddings) and our sinusoid table (interleaved sin/cos, position
  0 first) is written as the position encodings of both stacks: CTranslate2's built-in table is another one;
- post-norm (norm_first=False) or pre-norm with the final enc_norm/dec_norm as the stacks' layer_norm;
- ScaleNorm g * x / ||x|| is RMSNorm with every gain g / sqrt(d_model) (||x|| = sqrt(d_model) * rms(x)), its
  epsilon ~0 as our clamp only acts on an all-zero row;
- self-attention's qkv_proj rows are [q; k heads; v heads] (Attention.split_kv views kv as (2, K, Dh)), which is
  CTranslate2's fused layout; cross-attention is q_proj plus the fused kv_proj; MQA/GQA set num_heads_kv;
- MLA has no CTranslate2 layout, so it is folded: K/V = W_up (W_down x + b_down) + b_up is an ordinary linear
  map with weight W_up @ W_down and bias W_up @ b_down + b_up (the query latent likewise), computed in float64;
- vocabularies list our pieces in id order; <unk>/<bos>/<eos> are declared as CTranslate2's unk/bos/eos tokens
  and <bos> is the decoder start token; the source is fed with its eos, as our encoder reads it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

import data_preparation as dp
from checkpoint import find_checkpoint, load_checkpoint
from ct2_engine import EXPORT_FILE, FORMAT_VERSION, SPECIAL_TOKENS, require_ctranslate2
from runtime import UserError, cli_main
from transformer_model import Attention, ScaleNorm, Transformer, sinusoid_table

QUANTIZATIONS = {"float32": "float32", "int8": "int8", "int8_float32": "int8_float32", "int8_float16": "int8_float16",
                 "int8_bfloat16": "int8_bfloat16", "int16": "int16", "float16": "float16", "bf16": "bfloat16",
                 "bfloat16": "bfloat16"}  # our names -> CTranslate2's; bf16 is this project's spelling elsewhere
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which the model uses; CTranslate2 would assume 1e-6
RMS_NORM_EPS = 1e-12  # ScaleNorm as RMSNorm: an epsilon inside the root would shift every row's scale


# ---------------------------------------------------------------- weights -> spec


def _np(t: torch.Tensor):
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _set_linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _set_norm(spec, norm: torch.nn.Module) -> None:
    if isinstance(norm, ScaleNorm):
        spec.gamma = _np(norm.g.detach().expand(norm.d_model) / norm.d_model**0.5)
    else:
        spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _fold(up: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """up(W x + b) as one linear map: (W_up @ W, W_up @ b + b_up), in float64 so the fold adds no rounding."""
    w_up, b_up = up.weight.double(), up.bias.double()
    return w_up @ weight.double(), w_up @ bias.double() + b_up


def attention_weights(attn: Attention) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((W_q, b_q), (W_kv, b_kv)) as plain projections: W_kv rows are [k heads; v heads]; MLA is folded."""
    if attn.cross:
        q = (attn.q_proj.weight, attn.q_proj.bias)
        kv = (attn.kv_proj.weight, attn.kv_proj.bias)
    else:
        q_width = attn.widths[0]
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        q, kv = (w[:q_width], b[:q_width]), (w[q_width:], b[q_width:])
    if attn.q_up is not None:
        q = _fold(attn.q_up, *q)
    if attn.kv_up is not None:
        kv = _fold(attn.kv_up, *kv)  # kv_up's rows are [K; V] with heads in order, as split_kv expects
    return q, kv


def _set_attention(spec, attn: Attention, norm: torch.nn.LayerNorm) -> None:
    (w_q, b_q), (w_kv, b_kv) = attention_weights(attn)
    if attn.cross:
        _set_linear(spec.linear[0], w_q, b_q)
        _set_linear(spec.linear[1], w_kv, b_kv)
    else:
        _set_linear(spec.linear[0], torch.cat([w_q.double(), w_kv.double()]), torch.cat([b_q.double(), b_kv.double()]))
    _set_linear(spec.linear[-1], attn.out_proj.weight, attn.out_proj.bias)
    _set_norm(spec.layer_norm, norm)


def _set_ffn(spec, layer, norm: torch.nn.LayerNorm) -> None:
    _set_linear(spec.linear_0, layer.ff.w1.weight, layer.ff.w1.bias)
    _set_linear(spec.linear_1, layer.ff.w2.weight, layer.ff.w2.bias)
    _set_norm(spec.layer_norm, norm)


def build_spec(ct2, model: Transformer, src_vocab: list[str], tgt_vocab: list[str]):
    """A ctranslate2.specs.TransformerSpec holding the model's weights and vocabularies."""
    cfg = model.cfg
    if cfg.qk_norm:
        raise UserError("model.qk_norm: CTranslate2's Transformer has no QKNorm (scores g cos(q, k)); "
                        "translate this model with translate.py")
    specs = ct2.specs.transformer_spec
    kv_heads = cfg.num_kv_heads if cfg.num_kv_heads != cfg.n_heads else None
    rms = cfg.norm == "scale"
    encoder = specs.TransformerEncoderSpec(cfg.n_enc_layers, cfg.n_heads, pre_norm=cfg.norm_first,
                                           num_heads_kv=kv_heads, rms_norm=rms)
    decoder = specs.TransformerDecoderSpec(cfg.n_dec_layers, cfg.n_heads, pre_norm=cfg.norm_first,
                                           num_heads_kv=kv_heads, rms_norm=rms)
    table = _np(sinusoid_table(cfg.max_positions, cfg.d_model))

    def rows(w: torch.Tensor) -> torch.Tensor:  # FixNorm baked in: CTranslate2 has no such option
        return torch.nn.functional.normalize(w, dim=-1) if cfg.fix_norm else w

    encoder.embeddings[0].weight = _np(rows(model.src_embed.weight))
    encoder.position_encodings.encodings = table
    for spec, layer in zip(encoder.layer, model.encoder, strict=True):
        _set_attention(spec.self_attention, layer.self_attn, layer.norm1)
        _set_ffn(spec.ffn, layer, layer.norm2)
    decoder.embeddings.weight = _np(rows(model.tgt_embed.weight))
    decoder.position_encodings.encodings = table
    decoder.projection.weight = _np(rows(model.generator.weight))
    if model.output_ids is not None:  # tokens outside the output vocabulary: our -inf logit, as a bias
        bias = torch.full((cfg.tgt_vocab_size,), -1e9)  # (V,) finite: int8/fp16 conversions keep it a number
        decoder.projection.bias = _np(bias.index_fill(0, model.output_ids, 0.0))
    for spec, layer in zip(decoder.layer, model.decoder, strict=True):
        _set_attention(spec.self_attention, layer.self_attn, layer.norm1)
        _set_attention(spec.attention, layer.cross_attn, layer.norm2)
        _set_ffn(spec.ffn, layer, layer.norm3)
    if cfg.norm_first:
        _set_norm(encoder.layer_norm, model.enc_norm)
        _set_norm(decoder.layer_norm, model.dec_norm)
    spec = specs.TransformerSpec(encoder, decoder)
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    unk, bos, eos = SPECIAL_TOKENS["unk"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = unk, bos, eos
    spec.config.decoder_start_token = bos
    spec.config.add_source_bos = spec.config.add_source_eos = False  # encode_src already ends with eos
    spec.config.layer_norm_epsilon = RMS_NORM_EPS if rms else LAYER_NORM_EPS
    return spec


def vocabulary(tokenizer, lang: str) -> list[str]:
    """The tokenizer's pieces in id order; CTranslate2 looks tokens up by string, so they must be unique."""
    pieces = tokenizer.pieces(list(range(tokenizer.vocab_size(lang))), lang)
    expected = [SPECIAL_TOKENS[name] for name in ("pad", "unk", "bos", "eos")]
    if pieces[:len(expected)] != expected:
        raise UserError(f"the {lang} vocabulary starts with {pieces[:4]}, expected {expected}: not this project's "
                        "tokenizer layout")
    seen: set[str] = set()
    for i, piece in enumerate(pieces):
        if piece in seen:
            raise UserError(f"the {lang} vocabulary has the token {piece!r} twice (id {i}): CTranslate2 maps tokens "
                            "by string, so it cannot hold this vocabulary")
        seen.add(piece)
    return pieces


def make_converter(ct2, model: Transformer, tokenizer):
    """A ctranslate2.converters.Converter whose _load() builds the spec from our model and tokenizer."""

    class NmtConverter(ct2.converters.Converter):
        """Converter for this project's Transformer (weights already loaded, nothing read from disk)."""

        def _load(self):
            src_vocab = vocabulary(tokenizer, tokenizer.src_lang)
            tgt_vocab = vocabulary(tokenizer, tokenizer.tgt_lang)
            with torch.no_grad():
                return build_spec(ct2, model, src_vocab, tgt_vocab)

    return NmtConverter()


# ---------------------------------------------------------------- the export folder


def check_out_dir(out_dir: Path, force: bool) -> None:
    """OUT_DIR must be new, an empty folder, or (with force) an earlier export to replace."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UserError(f"{out_dir} exists and is not empty; use --force to replace it")
    if not out_dir.parent.is_dir():
        raise UserError(f"the folder {out_dir.parent} does not exist")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def export_info(file: Path, cfg, quantization: str | None, ct2_version: str) -> dict:
    """What nmt_export.json records: provenance, decode defaults, model and data config, special ids."""
    return {"format": FORMAT_VERSION, "engine": "ctranslate2", "ctranslate2_version": ct2_version,
            "source_checkpoint": str(file.resolve()), "source_sha256": sha256_file(file),
            "quantization": quantization or "float32", "decode": asdict(cfg.decode), "model": asdict(cfg.model),
            "data": asdict(cfg.data),  # the whole section: translate.py --reference SPLIT finds the split by it
            "special_ids": {"pad": dp.PAD_ID, "unk": dp.UNK_ID, "bos": dp.BOS_ID, "eos": dp.EOS_ID},
            "special_tokens": dict(SPECIAL_TOKENS)}


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished export into place; an earlier export is removed only once the new one is there."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_ctranslate2(checkpoint, out_dir, quantization: str | None = None, force: bool = False) -> Path:
    """Write the CTranslate2 folder for a run directory or .pt file; returns out_dir."""
    ct2 = require_ctranslate2()
    out_dir = Path(out_dir).resolve()  # "." has no name to derive the temporary folder's from
    check_out_dir(out_dir, force)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization} is unknown; use one of {', '.join(QUANTIZATIONS)}")
    ct2_quant = QUANTIZATIONS.get(quantization) if quantization else None
    file = find_checkpoint(checkpoint)
    if file.resolve().is_relative_to(out_dir):
        raise UserError(f"{out_dir} holds the checkpoint {file}: export to another folder")
    model, tokenizer, cfg = load_checkpoint(file, "cpu")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        make_converter(ct2, model, tokenizer).convert(str(tmp), quantization=ct2_quant, force=True)
        tokenizer.save(tmp / "tokenizer")
        info = export_info(file, cfg, ct2_quant, ct2.__version__)
        (tmp / EXPORT_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left over when something failed
    return out_dir


# ---------------------------------------------------------------- command line

EXAMPLES = """examples:
  python export.py --checkpoint runs/multi30k_en_de --to ctranslate2 exported/en_de
  python export.py --checkpoint runs/multi30k_en_de/checkpoint_best.pt --to ctranslate2 exported/en_de_int8 \\
      --quantization int8 --force

The folder is written under a temporary name and renamed when complete, so a failed export leaves nothing
behind. Translate from it with ct2_engine.load(folder).translate(lines); it needs `pip install ctranslate2`."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Export a trained checkpoint for a fast inference engine.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_PT",
                   help="run directory (checkpoint_avg.pt > _ema.pt > _best.pt > _last.pt) or a .pt file next to "
                        "tokenizer/")
    p.add_argument("--to", required=True, nargs=2, metavar=("ENGINE", "OUT_DIR"),
                   help="engine (only ctranslate2) and the folder to create")
    p.add_argument("--quantization", choices=sorted(QUANTIZATIONS), metavar="TYPE",
                   help="weight type: int8, int8_float32, bf16, float32, ... (default: float32 as trained; "
                        f"choices: {', '.join(sorted(QUANTIZATIONS))})")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engine, out_dir = args.to
    if engine != "ctranslate2":
        raise UserError(f"--to {engine}: unknown engine; the only one is ctranslate2")
    out = export_ctranslate2(args.checkpoint, out_dir, args.quantization, args.force)
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    cli_main(main)
