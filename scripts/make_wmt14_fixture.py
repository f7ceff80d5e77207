"""Write a synthetic WMT14 En-De corpus in the real file formats, for tests and the scale measurement.

Layout as the statmt.org archives unpack (docs/wmt14.md): training/europarl-v7.de-en.{de,en},
commoncrawl.de-en.{de,en}, training/news-commentary-v9.de-en.{de,en}, dev/newstest2013.{de,en} (plain text)
and test-full/newstest2014-deen-{src,ref}.{de,en}.sgm. The "German" side is a word-for-word mapping of the
English side with a few reorderings, so a tokenizer and a model have something regular to learn.

    python scripts/make_wmt14_fixture.py OUT_DIR [--pairs 3000]     # train pairs, split 40/50/10 % over corpora
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

EN = ("the house cat dog tree car city river house garden man woman child book table window door street "
      "train road school friend water light night day year time world small big old new green red blue "
      "is has sees likes takes gives finds makes runs walks reads writes and with without under over on in").split()
DE = ("das Haus Katze Hund Baum Auto Stadt Fluss Häuser Garten Mann Frau Kind Buch Tisch Fenster Tür Straße "
      "Zug Weg Schule Freund Wasser Licht Nacht Tag Jahr Zeit Welt klein groß alt neu grün rot blau "
      "ist hat sieht mag nimmt gibt findet macht läuft geht liest schreibt und mit ohne unter über auf in").split()
CORPORA = (("training/europarl-v7.de-en", 0.4), ("commoncrawl.de-en", 0.5), ("training/news-commentary-v9.de-en", 0.1))


def sentences(n: int, rng: np.random.Generator, max_words: int = 12) -> tuple[list[str], list[str]]:
    """n synthetic (en, de) sentence pairs of 2..max_words words, ending in a full stop."""
    lengths = rng.integers(2, max_words + 1, n)
    words = rng.integers(0, len(EN), int(lengths.sum()))
    en, de, start = [], [], 0
    for length in lengths.tolist():
        ids = words[start : start + length].tolist()
        start += length
        en.append(" ".join(EN[i] for i in ids).capitalize() + ".")
        de.append(" ".join(DE[i] for i in reversed(ids[:2]) if length > 3) + " " * (length > 3)
                  + " ".join(DE[i] for i in ids[2 if length > 3 else 0 :]).capitalize() + ".")
    return en, de


def write_plain(prefix: Path, en: list[str], de: list[str]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for lang, lines in (("en", en), ("de", de)):
        with open(f"{prefix}.{lang}", "w", encoding="utf-8") as f:
            f.writelines(f"{line}\n" for line in lines)


def write_sgm(path: Path, lines: list[str], lang: str, role: str) -> None:
    """An .sgm file as WMT publishes them: documents of <seg id="..">text</seg> lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = "srcset" if role == "src" else "refset"
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'<{tag} setid="newstest2014" srclang="any" trglang="{lang}">\n')
        for doc in range(0, len(lines), 7):
            f.write(f'<doc sysid="ref" docid="doc{doc}" genre="news" origlang="en">\n<p>\n')
            for i in range(doc, min(doc + 7, len(lines))):
                f.write(f'<seg id="{i - doc + 1}">{lines[i]}</seg>\n')
            f.write("</p>\n</doc>\n")
        f.write(f"</{tag}>\n")


def make_fixture(folder, pairs: int = 3000, valid: int = 200, test: int = 300, seed: int = 0) -> dict[str, int]:
    """Write the synthetic corpus under folder; returns the line count of each corpus (blank pairs included)."""
    folder, rng, counts = Path(folder), np.random.default_rng(seed), {}
    for name, share in CORPORA:
        en, de = sentences(max(int(pairs * share), 2), rng)
        if name == "commoncrawl.de-en":  # web crawl: a blank side and a very long line, as in the real one
            en[1], de[-1] = "", " ".join(["word"] * 300)
        write_plain(folder / name, en, de)
        counts[Path(name).name] = len(en)
    en, de = sentences(valid, rng)
    write_plain(folder / "dev/newstest2013", en, de)
    counts["newstest2013"] = valid
    en, de = sentences(test, rng)
    en[0] = "  The   &quot;big&quot;  house  "  # sacreBLEU collapses the spaces, keeps the entities
    for lang, lines in (("en", en), ("de", de)):
        write_sgm(folder / f"test-full/newstest2014-deen-src.{lang}.sgm", lines, lang, "src")
        write_sgm(folder / f"test-full/newstest2014-deen-ref.{lang}.sgm", lines, lang, "ref")
    counts["newstest2014"] = test
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="folder to write (data.raw_dir of a wmt14 config)")
    parser.add_argument("--pairs", type=int, default=3000, help="training pairs over the three corpora")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = make_fixture(args.out_dir, args.pairs, seed=args.seed)
    print(" ".join(f"{name}={n}" for name, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
