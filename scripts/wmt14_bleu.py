"""Score WMT14 En-De test output both ways papers report it.

1. Cased, detokenized sacreBLEU (with its signature): what to compare with current work.
2. Tokenized BLEU with compound splitting, as the Transformer paper (§6.1, via tensor2tensor's get_ende_bleu.sh)
   and fairseq (scripts/compound_split_bleu.sh) report it: Moses-tokenize hypotheses and references, split
   hyphenated compounds "a-b" -> "a ##AT##-##AT## b", then multi-bleu (case-sensitive, no further tokenization).
   It runs about 0.5-1 BLEU above sacreBLEU (fairseq: 29.3 tokenized+split = 28.6 sacreBLEU for one model).

    python scripts/wmt14_bleu.py RUN_DIR/hyps/newstest2014.txt PREPARED_DIR/newstest2014.de.txt [--lang de]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scoring import compound_split_bleu  # noqa: E402


def sacrebleu_with_signature(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """Cased detokenized sacreBLEU (13a tokenization) and its signature string."""
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hyps, [refs])
    return score.score, str(bleu.get_signature())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hyps", help="detokenized hypotheses, one per line")
    parser.add_argument("refs", help="references, one per line (e.g. PREPARED_DIR/newstest2014.de.txt)")
    parser.add_argument("--lang", default="de", help="target language for the Moses tokenizer")
    args = parser.parse_args(argv)
    hyps, refs = (open(p, encoding="utf-8").read().split("\n")[:-1] for p in (args.hyps, args.refs))
    score, signature = sacrebleu_with_signature(hyps, refs)
    print(f"sacreBLEU {score:.2f}  {signature}")
    print(f"tokenized BLEU with compound splitting {compound_split_bleu(hyps, refs, args.lang):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
