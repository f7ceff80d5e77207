"""Translate with a trained Transformer from the command line: sentences, files, standard input, BLEU against
references, n-best lists and cross-attention heatmaps.

Every mode is a thin layer on translator.Translator, so both engines serve all of them: torch (a run directory or
.pt file; the search is decoding.py, batched beam search with a KV cache, §6.1) and ctranslate2 (a folder written
by export.py, through ct2_engine.py). Scores come from scoring.py.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import data_preparation as dp
from decoding import clean
from runtime import UserError, atomic_write, cli_main, resolve_device
from scoring import format_scores, score
from translator import ENGINES, PRECISIONS, Translation, Translator, locate

BOM = "\ufeff"
STDIN_WAIT_S = 0.01  # a chunk of piped input waits this long for more before it is translated (see stdin_chunks)

# ---------------------------------------------------------------- attention heatmap


def plot_attention(t: Translation, out_path, layer: int | None = None, head: int | None = None,
                   all_heads: bool = False) -> Path:
    """Cross-attention heatmap (source pieces on x, output pieces on y) of a Translation made with attention=True.

    layer and head count from 1 (default: the last layer, mean over heads); all_heads: a grid of every head.
    """
    from matplotlib.figure import Figure  # the object API renders without pyplot's global backend state

    cross = torch.tensor(t.attention)  # (L,H,T,S): [layer][head][output piece][source piece]
    n_layers, n_heads = cross.size(0), cross.size(1)
    layer = n_layers if layer is None else layer
    if not 1 <= layer <= n_layers:
        raise UserError(f"--layer {layer} is out of range: the decoder has layers 1..{n_layers}")
    if head is not None and not 1 <= head <= n_heads:
        raise UserError(f"--head {head} is out of range: the model has heads 1..{n_heads}")
    attn = cross[layer - 1]  # (H,T,S)
    x_labels, y_labels = t.src_tokens, t.tgt_tokens  # source pieces ending with eos, output pieces with eos
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
  python translate.py --checkpoint runs/multi30k_en_de < in.en > out.de
  python translate.py --checkpoint runs/multi30k_en_de --input in.en --output out.de --beam 5
  python translate.py --checkpoint runs/multi30k_en_de --reference test_2016_flickr --output hyps.de --json
  python translate.py --checkpoint runs/multi30k_en_de/checkpoint_last.pt --nbest 3 "A dog runs."
  python translate.py --checkpoint runs/multi30k_en_de "A dog runs." --plot-attention attn.png --all-heads
  python translate.py --checkpoint exported/en_de < in.en > out.de      # a folder written by export.py
  python translate.py --checkpoint runs/a --checkpoint runs/b --reference test_2016_flickr   # an ensemble

--checkpoint takes a run directory (checkpoint_avg.pt, else _ema.pt, _best.pt, _last.pt: the trainer leaves the
final model it chose first in that order), a .pt file whose folder holds tokenizer/, or a CTranslate2 folder
written by export.py (--engine auto picks ctranslate2 for it; --engine ctranslate2 needs one, --engine torch
refuses one). Given more than once (runs or
.pt files trained with the same tokenizer), the models decode as an ensemble: each step's next-token
distribution is the mean of theirs; the decode settings come from the first. Without sentences or --input,
lines are read from standard input in chunks of up to --buffer-size lines, each translated as one batch and
written (flushed) in input order; a chunk ends early when the input pauses, so a terminal, or a program that
writes a line and waits for its answer, is answered line by line. One output line per input line (an empty
line gives an empty line). With --nbest N each input gives N lines "INDEX<TAB>SCORE<TAB>TRANSLATION", best
first, INDEX counting input lines from 0. With --reference the scores follow the translations on standard
output (a table, or one JSON line with --json); use --output to keep the translations out of the way. Lines
longer than the model's max_positions tokens are truncated with a warning. --output is written to a temporary
file renamed at the end, so a failed or killed run leaves an earlier file of that name untouched (a symlink's
target is written that way; a FIFO or device is written in place); it may not be a file the command reads. A
byte order mark at the start of the input is ignored. An n-best list may end with "-inf" filler lines when fewer
distinct hypotheses exist (a beam wider than the vocabulary allows within the length bound); an empty input line
gives one empty line. --debug shows the traceback of an error."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Translate sentences with a trained Transformer (beam search, BLEU, attention plots).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="*", help="sentences to translate, one output line each")
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR_OR_FILE", action="append",
                   help="run directory, .pt file, or a CTranslate2 folder written by export.py; given twice or "
                        "more: an ensemble of runs of one tokenizer (torch), the mean of their probabilities")
    p.add_argument("--engine", default="auto", choices=["auto", *ENGINES],
                   help="auto (default): ctranslate2 for an export.py folder, else torch")
    p.add_argument("--input", metavar="FILE", help="translate this UTF-8 text file, one sentence per line")
    p.add_argument("--output", metavar="FILE", help="write translations here instead of standard output")
    p.add_argument("--reference", metavar="FILE_OR_SPLIT",
                   help="score against this file, or a split of the checkpoint's dataset (e.g. "
                        "test_2016_flickr: its source is translated when no sentence or --input is given)")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON line")
    p.add_argument("--buffer-size", type=int, default=1000, metavar="N",
                   help="standard input: translate up to N lines per batch (default: 1000)")
    g = p.add_argument_group("search (defaults: the checkpoint's decode section)")
    g.add_argument("--beam", type=int, help="beam size; 1 = greedy search (paper: 4)")
    g.add_argument("--len-penalty", type=float, help="alpha of the penalty ((5+|Y|)/6)^alpha (paper: 0.6)")
    g.add_argument("--max-len-a", type=float, help="maximum output length is a * source length + b")
    g.add_argument("--max-len-b", type=int, help="see --max-len-a (paper: a=1, b=50)")
    g.add_argument("--nbest", type=int, default=1, help="print the N best hypotheses per input (N <= beam)")
    g.add_argument("--batch-tokens", type=int, help="source tokens (padding included) per batch")
    g.add_argument("--max-src-len", type=int, help="truncate longer sources (default: max_positions)")
    g.add_argument("--no-cache", action="store_true", help="recompute the prefix every step (slow; torch only)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    g.add_argument("--threads", type=int, help="CPU threads for torch and CTranslate2 (default: torch's choice; 1 "
                   "is often fastest for small models on a busy machine)")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="default: the checkpoint's decode.precision (fp32 unless set), as the training report "
                        "decodes; bf16 runs under autocast; int8 needs --engine ctranslate2")
    s = p.add_argument_group("HTTP server (server.py: the API and the page; engine torch)")
    s.add_argument("--serve", action="store_true", help="serve the model over HTTP instead of translating")
    s.add_argument("--host", default="127.0.0.1", help="--serve: address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="--serve: TCP port (default: 8000)")
    a = p.add_argument_group("attention plot (engine torch)")
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


def inputs_of(args: argparse.Namespace, source: Path) -> list[tuple[str, Path]]:
    """(flag, file) for every file this command reads: writing one of them would destroy it mid-run. source is
    the checkpoint file, or the export.py folder (every file in it)."""
    if source.is_dir():
        found = [("--checkpoint (its export folder)", f) for f in sorted(source.rglob("*")) if f.is_file()]
    else:
        found = [("--checkpoint", source), ("--checkpoint (its run's config.yaml)", source.parent / "config.yaml")]
        tokenizer = source.parent / "tokenizer"
        if tokenizer.is_dir():
            found += [("--checkpoint (its tokenizer/ folder)", f) for f in sorted(tokenizer.iterdir())]
    if args.input:
        found.append(("--input", Path(args.input)))
    if args.reference and Path(args.reference).is_file():
        found.append(("--reference", Path(args.reference)))
    return found


def output_path(path, args: argparse.Namespace, source: Path, flag: str = "--output") -> Path:
    """--output (or --plot-attention), checked before any work: a file in an existing folder, never a file the
    command reads (compared by path and inode, so a hard link or a symlink to an input counts too)."""
    if not path:
        raise UserError(f"{flag} is empty, expected a file path")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p} is a directory, expected a file path")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {p}: the folder {p.parent} does not exist")
    for what, file in inputs_of(args, source):
        if same_file(p, file):
            raise UserError(f"{flag} {p} is also the {what} file: write to another file")
    if p.exists() and p.suffix == ".pt":
        raise UserError(f"{flag} {p} is a checkpoint file: refusing to write over it")
    return p


def format_output(index: int, t: Translation, nbest: int) -> list[str]:
    """The output lines of one input: its translation, or nbest "INDEX<TAB>SCORE<TAB>TRANSLATION" lines."""
    if nbest == 1:
        return [clean(t.text)]
    return [f"{index}\t{s:.4f}\t{clean(h)}" for h, s in t.hypotheses]


def references(spec: str, cfg, tokenizer_dir: Path) -> tuple[list[str], list[str] | None]:
    """(reference lines, source lines or None) for --reference: an existing file, else a split name.
    tokenizer_dir: the run's tokenizer/, which a fine-tuned run (train.init_from) encoded its data with."""
    if Path(spec).exists():
        return read_lines(spec), None
    d = cfg.data
    tests = [Path(p).name for p in d.test_prefixes] if d.dataset == "files" else d.test_splits
    known = [name for name in (d.valid_split, *tests) if name]  # an older export records no split
    if spec not in known:
        raise UserError(f"--reference {spec}: no such file, and not a split of this checkpoint's dataset "
                        f"({', '.join(known) or 'it records none'})")
    with contextlib.redirect_stdout(sys.stderr):  # its summary must not mix with the translations
        # cached: reuses the prepared data of the training run when it is there (and its tokenizer is the key)
        prepared = dp.prepare(d, tokenizer=tokenizer_dir if cfg.train.init_from else None)
    return dp.read_raw(prepared, spec, d.tgt_lang), dp.read_raw(prepared, spec, d.src_lang)


def input_waiting(stream, timeout: float) -> bool:
    """Whether stream has more to read within timeout; one without a descriptor (in memory) always has."""
    try:
        return bool(select.select([stream.fileno()], [], [], timeout)[0])
    except (OSError, ValueError):  # io.BytesIO has no descriptor; Windows' select takes sockets only
        return True


def decode_lines(raw: list[bytes], number: int) -> tuple[list[str], int | None]:
    """(the UTF-8 lines without a trailing \\r, up to a bad one; the line number of that bad one or None).
    number: lines of the input before raw; a BOM (Windows editors) is no part of the input's first line."""
    texts = []
    for line in raw:
        try:
            text = line.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError:
            return texts, number + len(texts) + 1
        texts.append(text.removeprefix(BOM) if number + len(texts) == 0 else text)
    return texts, None


def stdin_chunks(buffer_size: int) -> Iterator[list[str]]:
    """Standard input in chunks of at most buffer_size lines, split on \\n only, line endings removed.

    A chunk is what has arrived: reading stops at buffer_size lines or when the input pauses (nothing more
    within STDIN_WAIT_S), so a file or a fast pipe fills whole chunks while a terminal, or a program that writes
    a line and waits for its answer, is answered line by line. A terminal gets a prompt on stderr. Before a
    line that is not UTF-8 the lines read so far are still given out, then the error is raised."""
    stream, prompt = sys.stdin.buffer, sys.stdin.isatty()
    buf, lines, number, eof = bytearray(), [], 0, False
    while lines or not eof:
        if not eof and len(lines) < buffer_size and (not lines or input_waiting(stream, STDIN_WAIT_S)):
            if prompt and not lines and not buf:
                print("> ", end="", file=sys.stderr, flush=True)
            data = stream.read1(1 << 16)  # what is there, up to 64 KiB: never waits for a full block
            buf += data
            cut = len(buf) if not data else buf.rfind(b"\n") + 1  # at the end, a last line without newline
            eof = not data
            if cut:
                lines += bytes(buf[:cut]).removesuffix(b"\n").split(b"\n")
                del buf[:cut]
            continue
        chunk, lines = lines[:buffer_size], lines[buffer_size:]
        texts, bad = decode_lines(chunk, number)
        if texts:
            yield texts
        if bad is not None:
            raise UserError(f"standard input is not UTF-8 text (line {bad})")
        number += len(chunk)


def search_options(args: argparse.Namespace, dec) -> dict:
    """The search settings of Translator.translate: command-line values, else the decode section; checked."""
    opts = {name: dec_value if arg is None else arg for name, arg, dec_value in [
        ("beam", args.beam, dec.beam), ("len_penalty", args.len_penalty, dec.len_penalty),
        ("max_len_a", args.max_len_a, dec.max_len_a), ("max_len_b", args.max_len_b, dec.max_len_b)]}
    checks = [(opts["beam"] >= 1, "--beam must be >= 1"),
              (1 <= args.nbest <= opts["beam"], f"--nbest must be between 1 and the beam ({opts['beam']})"),
              (opts["max_len_a"] >= 0, "--max-len-a must be >= 0"),
              # at least one token, as decode.max_len_b: a bound of 0 allows only the empty translation
              (opts["max_len_b"] >= 1, "--max-len-b must be >= 1")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    return opts


def write_translations(out, translate_lines: Callable[..., list[Translation]], sources: list[str] | None,
                       nbest: int, progress: bool, buffer_size: int) -> list[str]:
    """Translate sources, or standard input chunk by chunk as it arrives, into out (flushed after each chunk);
    returns the best translation of every input line."""
    best: list[str] = []
    for chunk in [sources] if sources is not None else stdin_chunks(buffer_size):
        found = translate_lines(chunk, progress=progress and sources is not None, first_line=len(best) + 1)
        out.write("".join(line + "\n" for i, t in enumerate(found, start=len(best))
                          for line in format_output(i, t, nbest)))
        out.flush()
        best += [t.text for t in found]
    return best


def check_numbers(args: argparse.Namespace) -> None:
    """argparse's float() takes 'nan', 'inf' and 1e999: a NaN length penalty scores every hypothesis NaN, an
    infinite length factor makes no bound at all. These and the other counts are refused before any work."""
    for flag, value in (("--len-penalty", args.len_penalty), ("--max-len-a", args.max_len_a)):
        if value is not None and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
    for flag, value, low in (("--batch-tokens", args.batch_tokens, 1), ("--max-src-len", args.max_src_len, 2),
                             ("--buffer-size", args.buffer_size, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} must be >= {low}")
    if args.threads is not None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # torch/OpenMP crashes (segfault) on absurd counts, and more threads than CPUs only slow it down
        if not 1 <= args.threads <= cpus:
            raise UserError(f"--threads must be between 1 and the {cpus} CPU(s) this process may use")


def torch_only(args: argparse.Namespace) -> None:
    """The options the ctranslate2 engine cannot honour, refused before any work."""
    if args.plot_attention is not None:
        raise UserError("--plot-attention needs --engine torch and a run directory or .pt file: CTranslate2 "
                        "gives no attention weights")
    if args.no_cache:
        raise UserError("--no-cache needs --engine torch: CTranslate2 always decodes with its cache")


def plot_path(args: argparse.Namespace, source: Path, output: Path | None) -> Path:
    """--plot-attention, checked before translating: an image format matplotlib writes, not a file we read."""
    p = Path(args.plot_attention)
    if p.is_dir():
        raise UserError(f"--plot-attention {p} is a directory, expected an image file path")
    for what, file in inputs_of(args, source) + ([("--output", output)] if output else []):
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


def load_translator(args: argparse.Namespace) -> tuple[Translator, Path | None]:
    """The Translator and the checked --output path; every check that needs no model runs first."""
    if args.text and args.input:
        raise UserError("give sentences as arguments or --input FILE, not both")
    if args.plot_attention and len(args.text) != 1:
        raise UserError("--plot-attention needs exactly one sentence given as an argument")
    check_numbers(args)
    (engine, source), *more = [locate(path, args.engine) for path in args.checkpoint]
    if engine != "torch":
        torch_only(args)
    if more and (args.plot_attention is not None or {engine, *(e for e, _ in more)} != {"torch"}):
        raise UserError("an ensemble (--checkpoint given more than once) needs run directories or .pt files "
                        "(engine torch) and no --plot-attention")
    device = resolve_device(args.device, "--device")
    output = None
    if args.output is not None:
        for checkpoint in [source, *(s for _, s in more)]:  # never a file of any member
            output = output_path(args.output, args, checkpoint)
    if args.plot_attention is not None:
        plot_path(args, source, output)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # the ctranslate2 engine takes torch's thread count too
    options = dict(device=str(device), precision=args.precision, batch_tokens=args.batch_tokens,
                   max_src_len=args.max_src_len, use_cache=not args.no_cache)
    if more:
        return Translator.load_ensemble([source, *(s for _, s in more)], **options), output
    return Translator.load(source, engine=engine, **options), output


def serve(args: argparse.Namespace) -> int:
    """--serve: hand the model options to server.py, the one HTTP implementation."""
    if len(args.checkpoint) > 1:
        raise UserError("--serve serves one model: give --checkpoint once")
    translating = [flag for flag, on in (("sentences", args.text), ("--input", args.input), ("--output", args.output),
                                         ("--reference", args.reference), ("--plot-attention", args.plot_attention))
                   if on]
    if translating:
        raise UserError(f"--serve serves requests; it takes no {', '.join(translating)}")
    if args.precision == "int8" or args.engine == "ctranslate2":
        raise UserError("--serve decodes with the torch engine (the page shows attention): no int8 or ctranslate2")
    import server  # fastapi and uvicorn only when serving

    argv = ["--checkpoint", args.checkpoint[0], "--host", args.host, "--port", str(args.port), "--device", args.device]
    argv += ["--precision", args.precision] if args.precision else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += ["--max-batch-tokens", str(args.batch_tokens)] if args.batch_tokens else []
    return server.main(argv)


def translate(argv) -> int:
    args = build_parser().parse_intermixed_args(argv)  # sentences before and after options
    if args.serve:
        return serve(args)
    tr, output = load_translator(args)
    opts = search_options(args, tr.cfg.decode)
    if args.plot_attention:  # plot_attention checks them too, but only after the translation was printed
        plot_layers(args, tr.cfg.model)

    def translate_lines(lines: list[str], progress: bool, first_line: int = 1) -> list[Translation]:
        return tr.translate(lines, nbest=args.nbest, progress=progress, first_line=first_line, **opts)

    refs, sources = references(args.reference, tr.cfg, tr.tokenizer.folder) if args.reference else (None, None)
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
            best = write_translations(out, translate_lines, sources, args.nbest, not args.text, args.buffer_size)
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
        (found,) = tr.translate(sources[:1], attention=True, **opts)  # the search behind the output
        path = plot_attention(found, args.plot_attention, args.layer, args.head, args.all_heads)
        print(f"attention plot: {path}", file=sys.stderr)
    if refs is not None:
        scores = score(best, refs, tr.cfg.data.tgt_lang)
        print(json.dumps(scores) if args.json else format_scores(scores), flush=True)
    return 0


if __name__ == "__main__":
    cli_main(main)
