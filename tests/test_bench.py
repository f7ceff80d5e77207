"""The speed benchmark runs end to end at toy sizes and writes every section; the GPU script parses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, run_script


def bench(tmp_path, *args: str, **extra_env: str) -> dict:
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "MULTI30K_DIR"}  # random sentences: no BPE training
    env.update(extra_env)
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_speed.py"), "--tiny", "--data-dir", "none",
         "--out", str(out), *args], cwd=tmp_path, env={**env, "NMT_DEBUG": "1"}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matmul peak" in result.stdout
    return json.loads(out.read_text("utf-8"))


def positive(value) -> bool:
    return isinstance(value, int | float) and value > 0 and value == value  # not NaN


def test_quick_tiny_run_writes_every_section(tmp_path):
    r = bench(tmp_path, "--quick", "--no-compile", "--prepared-dir", str(tmp_path / "prepared"))
    real = r["real_training"]
    assert set(real["runs"]) == {f"{m}_{p}" for m in ("ours", "torch")
                                 for p in ("fp32", "bf16") if p == "fp32" or r["env"]["cpu_native_bf16"]}
    for run in real["runs"].values():
        assert positive(run["tokens_per_s"]) and positive(run["mfu"]) and len(run["runs_tokens_per_s"]) == 2
    assert 0.5 < real["mean_real_target_fraction"] <= 1.0  # the trainer's batches: little padding
    assert real["model"]["d_model"] == 32, "the real batches come from configs/tiny.yaml under --tiny"
    assert r["env"]["threads"] >= 1 and isinstance(r["env"]["cpu_native_bf16"], bool)
    assert positive(r["matmul_peak_tflops"]["fp32"]) and positive(r["matmul_peak_tflops"]["bf16"])
    runs = r["training"]["runs"]
    assert set(runs) == {f"{m}_{p}" for m in ("ours", "naive", "torch") for p in ("fp32", "bf16")}
    params = {run["params"] for run in runs.values()}
    assert len(params) == 1, f"nn.Transformer baseline must have the same parameters as ours: {params}"
    for run in runs.values():
        assert positive(run["tokens_per_s"]) and positive(run["mfu"]) and positive(run["model_tflops"])
        assert len(run["runs_tokens_per_s"]) == 2  # --tiny repeats every configuration twice
    assert positive(r["training"]["speedup_vs_torch_fp32"]) and positive(r["training"]["speedup_vs_naive_bf16"])
    d = r["decoding"]
    assert positive(d["cached_sent_per_s"]) and positive(d["uncached_sent_per_s"]) and positive(d["cache_speedup"])
    assert d["same_output_fraction"] == 1.0, "cached and uncached beam search must find the same hypotheses"
    variants = r["attention_variants"]["variants"]
    assert list(variants) == ["mha", "mqa", "gqa", "mla"]
    for v in variants.values():
        assert positive(v["params"]) and positive(v["kv_cache_bytes_per_token_bf16"])
        assert positive(v["cached_sent_per_s"])
    kv = {k: v["kv_cache_bytes_per_token_bf16"] for k, v in variants.items()}
    assert kv["mqa"] < kv["gqa"] < kv["mha"] and kv["mla"] < kv["mha"]
    assert {t["name"].split(" (")[0] for t in r["targets"]} == {"training tok/s vs nn.Transformer",
                                                               "real batches: tok/s vs nn.Transformer",
                                                               "real batches: MFU of ours",
                                                               "cached vs uncached beam search"}
    mfu = [t for t in r["targets"] if t["name"].startswith("real batches: MFU")]
    assert {t["name"] for t in mfu} == {f"real batches: MFU of ours ({p})" for p in ("fp32", "bf16")
                                        if p == "fp32" or r["env"]["cpu_native_bf16"]}
    assert all(t["achieved"] == real["runs"][f"ours_{t['name'][-5:-1]}"]["mfu"] for t in mfu)


def test_real_batches_with_a_target_output_vocabulary(tmp_path):
    """A recipe with model.output_vocab: target (bench_speed.py --set): both contenders train over that output
    vocabulary (the baseline maps its targets to the same rows), and the FLOPs count its size, not the whole
    vocabulary's."""
    r = bench(tmp_path, "--quick", "--no-compile", "--skip-synthetic", "--skip-decoding", "--precisions", "fp32",
              "--set", "model.output_vocab=target", "--prepared-dir", str(tmp_path / "prepared"))
    real = r["real_training"]
    assert real["settings"] == ["model.output_vocab=target"]
    assert 0 < real["model"]["output_size"] < real["model"]["tgt_vocab_size"]
    assert all(positive(run["tokens_per_s"]) and positive(run["mfu"]) for run in real["runs"].values())


def test_profile_of_the_real_step(tmp_path):
    r = bench(tmp_path, "--quick", "--no-compile", "--skip-synthetic", "--skip-decoding", "--precisions", "fp32",
              "--profile", "5", "--prepared-dir", str(tmp_path / "prepared"))
    rows = r["real_training"]["profile"]["fp32"]
    assert len(rows) == 5 and all(positive(row["self_ms"]) for row in rows)
    shares = [row["share"] for row in rows]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0 + 1e-9
    assert any(row["op"] in ("aten::mm", "aten::addmm", "aten::bmm") for row in rows), rows  # the model's matmuls


def test_wmt14_base_mode(tmp_path):
    r = bench(tmp_path, "--wmt14-base-steps", "2", "--precisions", "fp32", NMT_NO_TCMALLOC="1")  # no re-exec
    w = r["wmt14_base"]
    assert w["steps"] >= 2 and positive(w["tokens_per_s"]) and positive(w["mfu"])
    assert "training" not in r


def test_gpu_script_parses():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    result = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_bench_help(tmp_path):
    result = run_script("bench/bench_speed.py", "--help", cwd=tmp_path, env={"NMT_NO_TCMALLOC": "1"})
    assert result.returncode == 0 and "--wmt14-base-steps" in result.stdout


def test_torch_baseline_projects_onto_the_output_vocabulary():
    """nn.Transformer's baseline computes logits over ours' output vocabulary only, rows of its tied table."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from train_real import TorchTransformer

    from transformer_model import ModelConfig

    cfg = ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, n_enc_layers=1, n_dec_layers=1,
                      d_ff=32, dropout=0.0, output_vocab="target", output_size=5)
    model = TorchTransformer(cfg).eval()
    model.output_ids = torch.tensor([1, 3, 5, 7, 9])
    src, tgt_in = torch.randint(1, 23, (2, 6)), torch.randint(1, 23, (2, 4))
    logits = model(src, tgt_in)
    assert logits.shape == (2, 4, 5)
    model.output_ids = None
    torch.testing.assert_close(logits, model(src, tgt_in)[..., [1, 3, 5, 7, 9]])
