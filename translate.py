"""Translate with a trained Transformer from the command line: sentences, files, standard input, BLEU against
references, n-best lists and cross-attention heatmaps.

The search itself (batched beam search with a KV cache, §6.1) is decoding.py; checkpoints are read by
checkpoint.py; scores come from scoring.py. This file is the command line on top of them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch

import data_preparation as dp
from checkpoint import find_checkpoint, load_checkpoint
from data_preparation import BOS_ID, EOS_ID
from decoding import clean, encode_sources, search_texts, source_limit, translate_nbest, translate_texts
from runtime import UserError, atomic_write, cli_main, resolve_device
from scoring import format_scores, score

BOM = "\ufeff"

# ---------------------------------------------------------------- attention heatmap


def fit_labels(labels: list[str], n: int) -> list[str]:
    """Exactly n tick labels: cut, or padded with '?' if the tokenizer's pieces disagree with the ids."""
    return (list(labels) + ["?"] * n)[:n]


def plot_attention(model, tokenizer, text: str, tokens: list[int], out_path, layer: int | None = None,
                   head: int | None = None, all_heads: bool = False, max_src_len: int | None = None) -> Path:
    """Cross-attention heatmap (source pieces on x, output pieces on y) from the explicit attention path.

    layer and head count from 1 (default: the last layer, mean over heads); all_heads: a grid of every head.
    """
    from matplotlib.figure import Figure  # the object API renders without pyplot's global backend state

    device = next(model.parameters()).device
    (src_ids,) = encode_sources(tokenizer, [text], source_limit(model, max_src_len))
    src = torch.tensor([src_ids], device=device)  # (1,S)
    tgt_in = torch.tensor([[BOS_ID, *tokens]], device=device)  # (1,T): row i is the step that outputs token i
    model.eval()
    with torch.inference_mode():
        cross = model.forward_with_attention(src, tgt_in).cross  # per decoder layer (1,H,T,S)
    n_layers, n_heads = len(cross), cross[0].size(1)
    layer = n_layers if layer is None else layer
    if not 1 <= layer <= n_layers:
        raise UserError(f"--layer {layer} is out of range: the decoder has layers 1..{n_layers}")
    if head is not None and not 1 <= head <= n_heads:
        raise UserError(f"--head {head} is out of range: the model has heads 1..{n_heads}")
    attn = cross[layer - 1][0].float().cpu()  # (H,T,S)
    pieces = tokenizer.src_pieces(text)  # ends with the eos piece, as the encoder reads it
    x_labels = fit_labels(pieces if len(pieces) <= len(src_ids) else pieces[:len(src_ids) - 1] + pieces[-1:],
                          attn.size(2))
    y_labels = fit_labels(tokenizer.tgt_pieces([*tokens, EOS_ID]), attn.size(1))
    if all_heads:
        panels = [(attn[h], f"head {h + 1}") for h in range(n_heads)]
    elif head is not None:
        panels = [(attn[head - 1], f"head {head}")]
    else:
        panels = [(attn.mean(dim=0), f"mean of {n_heads} heads")]
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    cell = 0.32  # inches per token keeps labels legible at any sentence length
    width, height = cols * (cell * attn.size(2) + 1.8), rows * (cell * attn.size(1) + 1.6)
    fig = Figure(figsize=(max(width, 5), max(height, 3.5)), layout="tight")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(w.max()) for w, _ in panels)  # one colour scale, so heads can be compared
    for ax, (w, title) in zip(axes.flat, panels, strict=False):
        im = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(x_labels)), x_labels, rotation=60, ha="right", rotation_mode="anchor",
                      fontsize=9)
        ax.set_yticks(range(len(y_labels)), y_labels, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("source")
        ax.set_ylabel("output")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"cross-attention, decoder layer {layer} of {n_layers}", fontsize=11)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fmt = out_path.suffix[1:].lower() or "png"  # a file object carries no suffix for matplotlib to go by
    with atomic_write(out_path, "wb") as f:
        fig.savefig(f, format=fmt, dpi=120)
    return out_path


# ---------------------------------------------------------------- command line

EXAMPLES = """examples:
  python translate.py --checkpoint runs/multi30k_en_de "A man is riding a bike." "Two dogs play."
  echo "A girl in a red coat." | python translate.py --checkpoint runs/multi30k_en_de
  python translate.py --checkpoint runs/multi30k_en_de --input in.en --output out.de --beam 5
  python translate.py --checkpoint runs/multi30k_en_de --reference test_2016_flickr --output hyps.de --json
  python translate.py --checkpoint runs/multi30k_en_de/checkpoint_last.pt --nbest 3 "A dog runs."
  python translate.py --checkpoint runs/multi30k_en_de "A dog runs." --plot-attention attn.png --all-heads

--checkpoint takes a run directory (checkpoint_avg.pt, else checkpoint_best.pt, else checkpoint_last.pt) or
a .pt file whose folder holds tokenizer/. Without sentences or --input, lines are read from standard input
and each translation is printed as soon as it is ready (one output line per input line; an empty line gives
an empty line). With --nbest N each input gives N lines "INDEX<TAB>SCORE<TAB>TRANSLATION", best first, INDEX
counting input lines from 0. With --reference the scores follow the translations on standard output (a table,
or one JSON line with --json); use --output to keep the translations out of the way. Lines longer than the
model's max_positions tokens are truncated with a warning. --output is written to a temporary file renamed at
the end, so a failed or killed run leaves an earlier file of that name untouched (a symlink's target is written
that way; a FIFO or device is written in place); it may not be a file the command reads. A byte order mark at
the start of the input is ignored. An n-best list may end with "-inf" filler lines when fewer distinct
hypotheses exist (a beam wider than the vocabulary allows within the length bound); an empty input line gives
one empty line. --debug shows the traceback of an error."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Translate sentences with a trained Transformer (beam search, BLEU, attention plots).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="*", help="sentences to translate, one output line each")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_FILE", help="run directory or .pt file")
    p.add_argument("--input", metavar="FILE", help="translate this UTF-8 text file, one sentence per line")
    p.add_argument("--output", metavar="FILE", help="write translations here instead of standard output")
    p.add_argument("--reference", metavar="FILE_OR_SPLIT",
                   help="score against this file, or a split of the checkpoint's dataset (e.g. "
                        "test_2016_flickr: its source is translated when no sentence or --input is given)")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON line")
    g = p.add_argument_group("search (defaults: the checkpoint's decode section)")
    g.add_argument("--beam", type=int, help="beam size; 1 = greedy search (paper: 4)")
    g.add_argument("--len-penalty", type=float, help="alpha of the penalty ((5+|Y|)/6)^alpha (paper: 0.6)")
    g.add_argument("--max-len-a", type=float, help="maximum output length is a * source length + b")
    g.add_argument("--max-len-b", type=int, help="see --max-len-a (paper: a=1, b=50)")
    g.add_argument("--nbest", type=int, default=1, help="print the N best hypotheses per input (N <= beam)")
    g.add_argument("--batch-tokens", type=int, help="source tokens (padding included) per batch")
    g.add_argument("--max-src-len", type=int, help="truncate longer sources (default: max_positions)")
    g.add_argument("--no-cache", action="store_true", help="recompute the prefix every step (slow)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice; 1 is often "
                   "fastest for small models on a busy machine)")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 runs under autocast")
    a = p.add_argument_group("attention plot")
    a.add_argument("--plot-attention", metavar="OUT.png", help="cross-attention heatmap of the sentence")
    a.add_argument("--layer", type=int, help="decoder layer, from 1 (default: the last)")
    a.add_argument("--head", type=int, help="one head, from 1 (default: the mean over heads)")
    a.add_argument("--all-heads", action="store_true", help="a grid with every head of the layer")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return p


def read_lines(path) -> list[str]:
    """Lines of a UTF-8 file split on \\n only (a stray \\r or form feed stays inside its line); \\r\\n ok."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"file not found: {p}")
    if p.is_dir():
        raise UserError(f"{p} is a directory, expected a text file")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{p} is not UTF-8 text (bad byte on line {line}); convert it (e.g. iconv)") from None
    lines = text.removeprefix(BOM).split("\n")  # a BOM (Windows editors) is no part of the first sentence
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return [line.removesuffix("\r") for line in lines]


def same_file(a: Path, b: Path) -> bool:
    """a and b are one file: the same resolved path, or the same inode (a hard link, a symlink, ../ detours)."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def inputs_of(args: argparse.Namespace, checkpoint: Path) -> list[tuple[str, Path]]:
    """(flag, file) for every file this command reads: writing one of them would destroy it mid-run."""
    found = [("--checkpoint", checkpoint), ("--checkpoint (its run's config.yaml)", checkpoint.parent / "config.yaml")]
    tokenizer = checkpoint.parent / "tokenizer"
    if tokenizer.is_dir():
        found += [("--checkpoint (its tokenizer/ folder)", f) for f in sorted(tokenizer.iterdir())]
    if args.input:
        found.append(("--input", Path(args.input)))
    if args.reference and Path(args.reference).is_file():
        found.append(("--reference", Path(args.reference)))
    return found


def output_path(path, args: argparse.Namespace, checkpoint: Path, flag: str = "--output") -> Path:
    """--output (or --plot-attention), checked before any work: a file in an existing folder, never a file the
    command reads (compared by path and inode, so a hard link or a symlink to an input counts too)."""
    if not path:
        raise UserError(f"{flag} is empty, expected a file path")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory, expected a file path")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {p}: the folder {p.parent} does not exist")
    for what, file in inputs_of(args, checkpoint):
        if same_file(p, file):
            raise UserError(f"{flag} {p} is also the {what} file: write to another file")
    if p.exists() and p.suffix == ".pt":
        raise UserError(f"{flag} {p} is a checkpoint file: refusing to write over it")
    return p


def format_output(index: int, hyps, nbest: int) -> list[str]:
    if nbest == 1:
        return [clean(hyps)]
    return [f"{index}\t{s:.4f}\t{clean(h)}" for h, s in hyps]


def references(spec: str, cfg, tokenizer_dir: Path) -> tuple[list[str], list[str] | None]:
    """(reference lines, source lines or None) for --reference: an existing file, else a split name.
    tokenizer_dir: the run's tokenizer/, which a fine-tuned run (train.init_from) encoded its data with."""
    if Path(spec).exists():
        return read_lines(spec), None
    d = cfg.data
    tests = [Path(p).name for p in d.test_prefixes] if d.dataset == "files" else d.test_splits
    known = [d.valid_split, *tests]
    if spec not in known:
        raise UserError(f"--reference {spec}: no such file, and not a split of this checkpoint's dataset "
                        f"({', '.join(known)})")
    with contextlib.redirect_stdout(sys.stderr):  # its summary must not mix with the translations
        # cached: reuses the prepared data of the training run when it is there (and its tokenizer is the key)
        prepared = dp.prepare(d, tokenizer=tokenizer_dir if cfg.train.init_from else None)
    return dp.read_raw(prepared, spec, d.tgt_lang), dp.read_raw(prepared, spec, d.src_lang)


def stdin_lines():
    """Standard input line by line as it arrives, split on \\n only, endings removed; prompt on a terminal."""
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="\n")  # no universal-newline split
    interactive = sys.stdin.isatty()
    number = 1
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = stdin.readline()
        except UnicodeDecodeError:
            raise UserError(f"standard input is not UTF-8 text (line {number})") from None
        if line == "":
            return
        if number == 1:
            line = line.removeprefix(BOM)
        yield line.removesuffix("\n").removesuffix("\r")
        number += 1


def search_options(args: argparse.Namespace, cfg, device: torch.device) -> dict:
    """The search settings: command-line values, else the checkpoint's decode section; checked."""
    dec = cfg.decode
    pick = {name: dec_value if arg is None else arg for name, arg, dec_value in [
        ("beam", args.beam, dec.beam), ("len_penalty", args.len_penalty, dec.len_penalty),
        ("max_len_a", args.max_len_a, dec.max_len_a), ("max_len_b", args.max_len_b, dec.max_len_b),
        ("batch_tokens", args.batch_tokens, dec.batch_tokens)]}
    opts = dict(pick, use_cache=not args.no_cache, device=device, precision=args.precision,
                max_src_len=args.max_src_len)
    checks = [(opts["beam"] >= 1, "--beam must be >= 1"),
              (1 <= args.nbest <= opts["beam"], f"--nbest must be between 1 and the beam ({opts['beam']})"),
              (opts["batch_tokens"] >= 1, "--batch-tokens must be >= 1"),
              (opts["max_len_a"] >= 0, "--max-len-a must be >= 0"),
              # at least one token, as decode.max_len_b: a bound of 0 allows only the empty translation
              (opts["max_len_b"] >= 1, "--max-len-b must be >= 1"),
              (args.max_src_len is None or args.max_src_len >= 2, "--max-src-len must be >= 2")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    return opts


def write_translations(out, translate_lines, sources: list[str] | None, nbest: int, progress: bool) -> list[str]:
    """Translate sources (or standard input, line by line as it arrives) into out; the best line per input."""
    best: list[str] = []
    if sources is not None:  # a known list: batched by length, progress bar for files and splits
        for i, hyps in enumerate(translate_lines(sources, progress=progress)):
            out.write("".join(line + "\n" for line in format_output(i, hyps, nbest)))
            best.append(hyps if nbest == 1 else hyps[0][0])
        return best
    for i, line in enumerate(stdin_lines()):
        (hyps,) = translate_lines([line], progress=False, first_line=i + 1)
        out.write("".join(text + "\n" for text in format_output(i, hyps, nbest)))
        out.flush()
        best.append(hyps if nbest == 1 else hyps[0][0])
    return best


def check_numbers(args: argparse.Namespace) -> None:
    """argparse's float() takes 'nan', 'inf' and 1e999: a NaN length penalty scores every hypothesis NaN, an
    infinite length factor makes no bound at all. Refused before any work."""
    for flag, value in (("--len-penalty", args.len_penalty), ("--max-len-a", args.max_len_a)):
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
    if args.threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # torch/OpenMP crashes (segfault) on absurd counts, and more threads than CPUs only slow it down
        if not 1 <= args.threads <= cpus:
            raise UserError(f"--threads must be between 1 and the {cpus} CPU(s) this process may use")


def plot_path(args: argparse.Namespace, checkpoint: Path, output: Path | None) -> Path:
    """--plot-attention, checked before translating: an image format matplotlib writes, not a file we read."""
    p = Path(args.plot_attention)
    if p.is_dir():
        raise UserError(f"--plot-attention {p} is a directory, expected an image file path")
    for what, file in inputs_of(args, checkpoint) + ([("--output", output)] if output else []):
        if same_file(p, file):
            raise UserError(f"--plot-attention {p} is also the {what} file: write to another file")
    from matplotlib.figure import Figure  # only when plotting: matplotlib takes a while to import

    formats = Figure().canvas.get_supported_filetypes()  # matplotlib raised this only after the translation
    if p.suffix and p.suffix[1:].lower() not in formats:
        raise UserError(f"--plot-attention {p}: matplotlib cannot write '{p.suffix}' images; use one of "
                        f"{', '.join(sorted(formats))}")
    return p


def plot_layers(args: argparse.Namespace, model_cfg) -> None:
    """--layer and --head within the model, checked before translating."""
    if args.layer is not None and not 1 <= args.layer <= model_cfg.n_dec_layers:
        raise UserError(f"--layer {args.layer} is out of range: the decoder has layers 1..{model_cfg.n_dec_layers}")
    if args.head is not None and not 1 <= args.head <= model_cfg.n_heads:
        raise UserError(f"--head {args.head} is out of range: the model has heads 1..{model_cfg.n_heads}")


def output_error(e: OSError, output: Path) -> UserError:
    """A failed write of --output as one line naming the file (disk full is the usual cause)."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "the disk is full (no space left on device)" if full else (e.strerror or str(e))
    return UserError(f"cannot write --output {output}: {reason}")


def main(argv=None) -> int:
    """The command; SIGTERM and SIGHUP (kill, a closed terminal) end it through SystemExit like Ctrl-C does
    through KeyboardInterrupt, so atomic_write deletes its temp file instead of leaving NAME.tmpXXXX."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        return translate(argv)

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return translate(argv)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def translate(argv) -> int:
    args = build_parser().parse_intermixed_args(argv)  # sentences before and after options
    if args.text and args.input:
        raise UserError("give sentences as arguments or --input FILE, not both")
    if args.plot_attention and len(args.text) != 1:
        raise UserError("--plot-attention needs exactly one sentence given as an argument")
    check_numbers(args)
    device = resolve_device(args.device, "--device")
    ckpt_file = find_checkpoint(args.checkpoint)
    output = output_path(args.output, args, ckpt_file) if args.output is not None else None
    if args.plot_attention is not None:
        plot_path(args, ckpt_file, output)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer, cfg = load_checkpoint(args.checkpoint, device)
    opts = search_options(args, cfg, device)
    if args.plot_attention:  # plot_attention checks them too, but only after the translation was printed
        plot_layers(args, cfg.model)

    def translate_lines(lines: list[str], progress: bool, first_line: int = 1) -> list:
        more = dict(opts, progress=progress, first_line=first_line)
        if args.nbest == 1:
            return translate_texts(model, tokenizer, lines, **more)
        return translate_nbest(model, tokenizer, lines, args.nbest, **more)

    refs, sources = references(args.reference, cfg, tokenizer.folder) if args.reference else (None, None)
    if args.text:
        sources = args.text
    elif args.input:
        sources = read_lines(args.input)
    if refs is not None and sources is not None and len(refs) != len(sources):  # found now, not after the work
        raise UserError(f"--reference has {len(refs)} reference lines but there are {len(sources)} sentences to "
                        "translate: give one reference line per input line")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")
    try:
        with atomic_write(output, newline="\n") if output else contextlib.nullcontext(sys.stdout) as out:
            best = write_translations(out, translate_lines, sources, args.nbest, progress=not args.text)
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly, like other command-line tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if output is None or e.filename != str(output):  # atomic_write names the output in its errors
            raise
        raise output_error(e, output) from e
    sys.stdout.flush()
    if args.plot_attention:
        if not sources[0].strip():
            raise UserError("--plot-attention: the sentence is empty, nothing to plot")
        (found,) = search_texts(model, tokenizer, sources[:1], **opts)  # the search behind the output
        path = plot_attention(model, tokenizer, sources[0], found[0][0], args.plot_attention,
                              args.layer, args.head, args.all_heads, args.max_src_len)
        print(f"attention plot: {path}", file=sys.stderr)
    if refs is not None:
        scores = score(best, refs, cfg.data.tgt_lang)
        print(json.dumps(scores) if args.json else format_scores(scores), flush=True)
    return 0


if __name__ == "__main__":
    cli_main(main)
