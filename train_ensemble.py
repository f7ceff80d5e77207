"""Train N models of one recipe at once and score them as an ensemble (decoding.Ensemble).

Each member is an ordinary run of train_transformer.py with its own seed (1..N), in OUT_DIR/seedK with its log
in OUT_DIR/seedK.log; the CPU cores are split between the members (one thread each on a 2-core machine). When
all are done, the ensemble (the mean of the members' next-token probabilities) translates the validation and
test splits with the recipe's decode settings: OUT_DIR/results.json and a table. On Multi30k two models gained
0.7-1.2 validation BLEU over either alone (docs/multi30k_sweeps.md, "A two-model ensemble for De→En").

    python train_ensemble.py --config configs/multi30k_de_en.yaml --out-dir runs/de_en_ensemble
    python translate.py --checkpoint runs/de_en_ensemble/seed1 --checkpoint runs/de_en_ensemble/seed2 < in.de

A member whose run already finished (its results.json exists) is not trained again and an interrupted one
resumes from its last checkpoint, so an interrupted command can be run again as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import data_preparation as dp
from config import load_config
from runtime import UserError, cli_main, write_text
from scoring import format_scores, score
from translator import Translator

ROOT = Path(__file__).resolve().parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the members' YAML config (train.seed and train.out_dir are set "
                   "per member)")
    p.add_argument("--out-dir", required=True, help="folder for the members' runs and the ensemble's results")
    p.add_argument("--members", type=int, default=2, help="how many models (default: 2)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per member (default: the cores divided among the members, at least 1)")
    p.add_argument("overrides", nargs="*", help="section.key=value for every member, as train_transformer.py takes")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    args = p.parse_args(argv)
    if args.members < 2:
        raise UserError("--members must be at least 2: one model is a plain run of train_transformer.py")
    if args.threads < 0:
        raise UserError("--threads must be >= 0 (0 = the cores divided among the members)")
    if any(o.split("=", 1)[0] in ("train.seed", "train.out_dir") for o in args.overrides):
        raise UserError("train.seed and train.out_dir are set per member (seeds 1..N in OUT_DIR/seedK)")
    return args


def train_members(args: argparse.Namespace, runs: list[Path], threads: int, max_steps: int) -> None:
    """Run the members that have not finished yet, all at once; each evaluation they log is printed."""
    out = runs[0].parent
    todo = [run for run in runs if not (run / "results.json").is_file()]
    procs = {}
    for run in runs:
        if run not in todo:
            print(f"{run}: already trained (its results.json exists), not trained again", flush=True)
    for run in todo:
        command = [sys.executable, str(ROOT / "train_transformer.py"), "--config", args.config, *args.overrides,
                   f"train.seed={run.name.removeprefix('seed')}", f"train.out_dir={run}", *restart(run)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(out / f"{run.name}.log", "wb") as log:
            procs[run] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        print(f"training {run} ({threads} thread{'s' * (threads > 1)}; log {out / run.name}.log)", flush=True)
    seen = {run: 0 for run in todo}
    try:
        while procs:
            time.sleep(2)
            for run in list(procs):
                seen[run] = report_progress(run, seen[run], max_steps)
                if procs[run].poll() is not None:
                    failed = procs.pop(run).returncode
                    if failed:
                        tail = (out / f"{run.name}.log").read_text("utf-8", "replace").strip().splitlines()[-3:]
                        raise UserError(f"member {run.name} failed (exit {failed}): {' | '.join(tail)}")
    finally:
        for proc in procs.values():  # one member failed, or Ctrl-C: stop the others too
            proc.terminate()


def restart(run: Path) -> list[str]:
    """An interrupted member continues from its last checkpoint (the trainer's exact resume); one stopped before
    its first checkpoint starts over."""
    if (run / "checkpoint_last.pt").is_file():
        return ["train.resume=true"]
    return ["train.overwrite=true"] if run.is_dir() and any(run.iterdir()) else []


def report_progress(run: Path, seen: int, max_steps: int) -> int:
    """Print the evaluations logged to run/metrics.jsonl since line `seen`; the new count of lines."""
    with contextlib.suppress(OSError):
        lines = (run / "metrics.jsonl").read_text("utf-8").splitlines()
        for line in lines[seen:]:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                m = json.loads(line)
                print(f"{run.name}: step {m['step']}/{max_steps}, val loss {m['val_loss']:.3f}, "
                      f"greedy val BLEU {m['val_bleu']:.2f}", flush=True)
        return len(lines)
    return seen


def score_ensemble(runs: list[Path]) -> dict:
    """The ensemble's scores on the validation and test splits, translated with the first member's decode
    settings (decode.*, as each member's own report)."""
    tr = Translator.load_ensemble(runs)
    d = tr.cfg.data
    with contextlib.redirect_stdout(sys.stderr):  # the members' own prepared folder (cached), as translate.py finds it
        prepared = dp.prepare(d, tokenizer=tr.tokenizer.folder if tr.cfg.train.init_from else None)
    results = {}
    for split in [d.valid_split, *dp.load_meta(prepared)["test_splits"]]:
        hyps = [t.text for t in tr.translate(dp.read_raw(prepared, split, d.src_lang), progress=True)]
        results[split] = score(hyps, dp.read_raw(prepared, split, d.tgt_lang), d.tgt_lang)
        print(f"{split}, the ensemble:\n{format_scores(results[split])}", flush=True)
    return results


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    start = time.time()
    cfg = load_config(args.config, args.overrides)  # bad values fail here, before any member starts
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg.train.init_from:  # once, before the members would each build it (fine-tuning: the source's tokenizer)
        dp.prepare(cfg.data)
    runs = [out / f"seed{k}" for k in range(1, args.members + 1)]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.members)
    train_members(args, runs, threads, cfg.train.max_steps)
    trained = time.time()
    tests = score_ensemble(runs)
    minutes = {"training": (trained - start) / 60, "total": (time.time() - start) / 60}
    members = {run.name: json.loads((run / "results.json").read_text("utf-8"))["tests"] for run in runs}
    result = {"members": [str(run) for run in runs], "minutes": minutes, "threads_per_member": threads,
              "decode": {"beam": cfg.decode.beam, "len_penalty": cfg.decode.len_penalty}, "tests": tests,
              "member_tests": members}
    write_text(out / "results.json", json.dumps(result, indent=1) + "\n")
    print(f"ensemble of {len(runs)}: {minutes['training']:.1f} min training, {minutes['total']:.1f} min in all; "
          f"{out / 'results.json'}")
    print(f"{'split':<20}{'ensemble':>14}" + "".join(f"{run.name:>14}" for run in runs)
          + "   (cased sacreBLEU / tokenized lowercased)")
    for split, s in tests.items():
        print(f"{split:<20}{both_bleus(s):>14}" + "".join(f"{both_bleus(members[r.name][split]):>14}" for r in runs))


def both_bleus(scores: dict) -> str:
    """'cased / tokenized lowercased': a lowercase run (data.lowercase) is judged on the second."""
    return f"{scores['bleu']:.2f} / {scores['bleu_tok_lc']:.2f}"


if __name__ == "__main__":
    cli_main(main)
