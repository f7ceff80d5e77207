"""Corpus acquisition: find each split's raw parallel files, or download them, checked, into data.raw_dir.

- Multi30k task 1 (Elliott et al. 2016): the published .gz files, pinned by sha256 ($MULTI30K_DIR: a shared copy).
- WMT14 En-De (the paper's §5.1): statmt.org archives, extracted flat, line counts checked; .sgm test sets.
- A user's own corpus: files PREFIX.LANG, one sentence per line.
Every dataset function maps a DataConfig to {split: {lang: path (or paths)}}; iter_lines streams any of them.

Environment: NMT_DOWNLOAD_URL_BASE replaces the Multi30k download URL (a mirror, or file:///some/dir offline);
NMT_WMT14_URL_BASE does the same for the statmt.org WMT14 archives.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import re
import shutil
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from config import DataConfig
from runtime import UserError, atomic_write

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
MULTI30K_LANGS = ("en", "de", "fr", "cs")
MULTI30K_SPLITS = {  # split -> languages published for it (Czech exists only up to the 2016 test set)
    "train": MULTI30K_LANGS,
    "val": MULTI30K_LANGS,
    "test_2016_flickr": MULTI30K_LANGS,
    "test_2017_flickr": ("en", "de", "fr"),
    "test_2017_mscoco": ("en", "de", "fr"),
}
MULTI30K_SHA256 = {  # of the published .gz files, so a truncated or altered download never gets used
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.fr.gz": "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
    "test_2017_mscoco.fr.gz": "754f3072ba9f124569ba5258b32730fc1d214bbf8e0c6dfb2b74401676220db0",
}
RETRY_DELAYS = (1.0, 4.0)  # seconds to wait before the 2nd and 3rd download attempt


def _transient(error: Exception) -> bool:
    """Worth another attempt: network hiccups, server errors, bad transfers; not a 404 or a disk error."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500 or error.code == 429
    if isinstance(error, urllib.error.URLError):
        return not isinstance(error.reason, (FileNotFoundError, PermissionError))
    return isinstance(error, (ValueError, http.client.HTTPException, TimeoutError, ConnectionError))


def download(url: str, dest: Path, sha256: str | None, md5: str | None = None) -> None:
    """Fetch url into dest via a temp file checked against the pinned digests: never a partial dest.

    A digest left as None is not checked (say so where it is documented: docs/wmt14.md checks line counts).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(len(RETRY_DELAYS) + 1):
        try:
            digests = {"sha256": (hashlib.sha256(), sha256), "md5": (hashlib.md5(usedforsecurity=False), md5)}
            with urllib.request.urlopen(url, timeout=30) as response, atomic_write(dest, "wb") as out:
                size = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(total=size, unit="B", unit_scale=True, desc=f"download {dest.name}", leave=False) as bar:
                    while chunk := response.read(1 << 16):
                        out.write(chunk)
                        for digest, _ in digests.values():
                            digest.update(chunk)
                        bar.update(len(chunk))
                for name, (digest, pinned) in digests.items():  # inside: a mismatch never reaches dest
                    if pinned is not None and digest.hexdigest() != pinned:
                        raise ValueError(f"{name} mismatch: got {digest.hexdigest()}, expected {pinned}")
            return
        except (OSError, ValueError, http.client.HTTPException) as e:
            if attempt == len(RETRY_DELAYS) or not _transient(e):
                raise
            time.sleep(RETRY_DELAYS[attempt])


def _multi30k_file(raw_dir: Path, split: str, lang: str) -> Path:
    """The raw file of one Multi30k split and language: plain or gzipped in raw_dir (or in $MULTI30K_DIR, a
    shared read-only copy), else downloaded into raw_dir."""
    folders = [raw_dir] + ([Path(os.environ["MULTI30K_DIR"])] if os.environ.get("MULTI30K_DIR") else [])
    for folder in folders:
        for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
            if (folder / name).is_file():
                return folder / name
    name = f"{split}.{lang}.gz"
    url = (os.environ.get("NMT_DOWNLOAD_URL_BASE") or MULTI30K_URL).rstrip("/") + f"/{name}"
    try:
        download(url, raw_dir / name, MULTI30K_SHA256[name])
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = " ".join(str(e).split())
        raise UserError(f"{name} is not in data.raw_dir={raw_dir} and downloading {url} failed ({reason}); "
                        f"copy the Multi30k files into data.raw_dir or check the network") from None
    return raw_dir / name


def multi30k_files(cfg: DataConfig) -> dict[str, dict[str, Path]]:
    """Multi30k task 1 (Elliott et al. 2016): {split: {lang: path}} for train, valid and test splits."""
    for lang in (cfg.src_lang, cfg.tgt_lang):
        if lang not in MULTI30K_LANGS:
            raise UserError(f"Multi30k has no language '{lang}'; choose from {', '.join(MULTI30K_LANGS)}")
    splits = list(dict.fromkeys(["train", cfg.valid_split, *cfg.test_splits]))
    for split in splits:
        if split not in MULTI30K_SPLITS:
            raise UserError(f"Multi30k has no split '{split}'; choose from {', '.join(MULTI30K_SPLITS)}")
        for lang in (cfg.src_lang, cfg.tgt_lang):
            if lang not in MULTI30K_SPLITS[split]:
                have = ", ".join(MULTI30K_SPLITS[split])
                raise UserError(f"Multi30k split {split} has no '{lang}' side (only {have}); drop that split")
    raw_dir = Path(cfg.raw_dir)
    return {split: {lang: _multi30k_file(raw_dir, split, lang) for lang in (cfg.src_lang, cfg.tgt_lang)}
            for split in splits}


def user_files(cfg: DataConfig) -> dict[str, dict[str, Path]]:
    """A user's corpus, files {prefix}.{lang}: the valid split is data.valid_split, tests by basename."""
    if not cfg.train_prefix or not cfg.valid_prefix:
        raise UserError("dataset 'files' needs data.train_prefix and data.valid_prefix (files PREFIX.LANG)")
    prefixes = {"train": ("data.train_prefix", cfg.train_prefix),
                cfg.valid_split: ("data.valid_prefix", cfg.valid_prefix)}
    for prefix in cfg.test_prefixes:
        if Path(prefix).name in prefixes:
            raise UserError(f"data.test_prefixes: split name '{Path(prefix).name}' is taken; rename a file")
        prefixes[Path(prefix).name] = ("data.test_prefixes", prefix)
    files = {}
    for split, (key, prefix) in prefixes.items():
        files[split] = {}
        for lang in (cfg.src_lang, cfg.tgt_lang):
            path = Path(f"{prefix}.{lang}")
            if path.is_dir():
                raise UserError(f"{path} is a directory, expected a text file (from {key}={prefix!r})")
            if not path.is_file():
                raise UserError(f"data file not found: {path} (from {key}={prefix!r})")
            files[split][lang] = path
    return files


# WMT14 En-De as in the paper (§5.1) and fairseq's prepare-wmt14en2de.sh: three training corpora, newstest2013
# for validation, the full newstest2014 (3003 sentences, sacreBLEU's "wmt14/full") for testing.
WMT14_URL = "https://statmt.org"
WMT14_TRAIN = ("europarl-v7.de-en", "commoncrawl.de-en", "news-commentary-v9.de-en")
WMT14_ARCHIVES = {  # local name -> (path under WMT14_URL, sha256, md5, files extracted from it)
    # No sha256/md5 could be checked when this was written (no network): None = not checked; the extracted
    # files' line counts (WMT14_LINES) are checked instead. The two md5 sums are sacreBLEU 2.6's pins.
    "training-parallel-europarl-v7.tgz": ("wmt13/training-parallel-europarl-v7.tgz", None, None,
                                          ("europarl-v7.de-en.de", "europarl-v7.de-en.en")),
    "training-parallel-commoncrawl.tgz": ("wmt13/training-parallel-commoncrawl.tgz", None, None,
                                          ("commoncrawl.de-en.de", "commoncrawl.de-en.en")),
    "training-parallel-nc-v9.tgz": ("wmt14/training-parallel-nc-v9.tgz", None, None,
                                    ("news-commentary-v9.de-en.de", "news-commentary-v9.de-en.en")),
    "wmt13-test.tgz": ("wmt13/test.tgz", None, "48eca5d02f637af44e85186847141f67",
                       ("newstest2013-src.de.sgm", "newstest2013-src.en.sgm")),
    "test-full.tgz": ("wmt14/test-full.tgz", None, "a8cd784e006feb32ac6f3d9ec7eb389a",
                      ("newstest2014-deen-src.de.sgm", "newstest2014-deen-src.en.sgm",
                       "newstest2014-deen-ref.de.sgm", "newstest2014-deen-ref.en.sgm")),
}
WMT14_LINES = {  # lines (segments for .sgm) per file, by corpus: the published WMT14 sizes, 4,520,620 train pairs
    "europarl-v7.de-en": 1_920_209, "commoncrawl.de-en": 2_399_123, "news-commentary-v9.de-en": 201_288,
    "newstest2013": 3000, "newstest2014": 3003,
}
WMT14_FOLDERS = ("", "training", "dev", "test", "test-full")  # where in raw_dir files are looked for


def _wmt14_names(split: str, lang: str, side: str) -> list[str]:
    """File names that hold one side of a split, best first: the .sgm of the archives, then plain text."""
    if split == "train":
        return [f"{corpus}.{lang}" for corpus in WMT14_TRAIN]
    role = "src" if side == "src" else "ref"
    return [f"{split}-deen-{role}.{lang}.sgm", f"{split}-src.{lang}.sgm", f"{split}.{lang}"]


def _wmt14_find(raw_dir: Path, name: str) -> Path | None:
    for folder in WMT14_FOLDERS:
        if (raw_dir / folder / name).is_file():
            return raw_dir / folder / name
    return None


def wmt14_corpus(path: Path) -> str:
    """'newstest2014' for newstest2014-deen-ref.de.sgm, 'commoncrawl.de-en' for commoncrawl.de-en.de."""
    test_set = re.match(r"newstest\d+", path.name)
    return test_set.group(0) if test_set else path.name.removesuffix(".gz").rsplit(".", 1)[0]


def _wmt14_fetch(raw_dir: Path, archive: str) -> None:
    """Download one archive, extract the files we use into raw_dir (flat: member paths are never used as
    destinations, so no path traversal), check their line counts, delete the archive."""
    rel, sha256, md5, members = WMT14_ARCHIVES[archive]
    url = (os.environ.get("NMT_WMT14_URL_BASE") or WMT14_URL).rstrip("/") + f"/{rel}"
    dest = raw_dir / archive
    try:
        download(url, dest, sha256, md5)
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = " ".join(str(e).split())
        raise UserError(f"downloading {url} failed ({reason}); place the WMT14 files in data.raw_dir={raw_dir} "
                        f"by hand (see docs/wmt14.md) or check the network") from None
    extracted = []
    try:
        with tarfile.open(dest, "r:*") as tar:
            for member in tar:
                name = PurePosixPath(member.name).name
                if member.isfile() and name in members and name not in {p.name for p in extracted}:
                    with tar.extractfile(member) as f, atomic_write(raw_dir / name, "wb") as out:
                        shutil.copyfileobj(f, out, 1 << 20)
                    extracted.append(raw_dir / name)
        missing = sorted(set(members) - {p.name for p in extracted})
        if missing:
            raise UserError(f"{url} does not contain {', '.join(missing)}; place the files by hand (docs/wmt14.md)")
        for path in extracted:
            expected, got = WMT14_LINES.get(wmt14_corpus(path)), count_lines(path)
            if expected is not None and got != expected:
                raise UserError(f"{path.name} from {url} has {got} lines, expected {expected}: the archive is not "
                                f"the published WMT14 one; place the files by hand (docs/wmt14.md)")
    except (tarfile.TarError, OSError, EOFError) as e:
        for path in extracted:
            path.unlink(missing_ok=True)
        raise UserError(f"cannot extract {dest} ({e}); delete it and retry, or place the files by hand") from None
    except UserError:
        for path in extracted:
            path.unlink(missing_ok=True)
        raise
    finally:
        dest.unlink(missing_ok=True)


def _wmt14_get(raw_dir: Path, names: list[str], split: str, lang: str) -> Path:
    """Download the archive that has the first of names, and return where that file now is."""
    for name in names:
        archive = next((a for a, spec in WMT14_ARCHIVES.items() if name in spec[3]), None)
        if archive is not None:
            _wmt14_fetch(raw_dir, archive)
            return _wmt14_find(raw_dir, name)
    raise UserError(f"{split}.{lang}: none of {', '.join(names)} is in data.raw_dir={raw_dir} and no known archive "
                    f"has it; see docs/wmt14.md for the expected files")


def wmt14_files(cfg: DataConfig) -> dict[str, dict[str, Path | list[Path]]]:
    """WMT14 En-De: {split: {lang: path or paths}}; train = Europarl v7 + Common Crawl + News Commentary v9.

    Files are read from data.raw_dir (or its training/ dev/ test/ test-full/ folders); what is missing is
    downloaded from statmt.org (NMT_WMT14_URL_BASE: a mirror with the same layout, file:// works).
    """
    if {cfg.src_lang, cfg.tgt_lang} != {"en", "de"}:
        raise UserError(f"dataset wmt14 is English-German: set data.src_lang/tgt_lang to en and de "
                        f"(got {cfg.src_lang}, {cfg.tgt_lang})")
    splits = list(dict.fromkeys(["train", cfg.valid_split, *cfg.test_splits]))
    for split in splits:
        if split != "train" and not re.fullmatch(r"newstest20\d\d", split):
            raise UserError(f"WMT14 has no split '{split}'; use data.valid_split=newstest2013 and "
                            f"data.test_splits=[newstest2014]")
    raw_dir = Path(cfg.raw_dir)
    files = {}
    for split in splits:
        files[split] = {}
        for lang, side in ((cfg.src_lang, "src"), (cfg.tgt_lang, "tgt")):
            names = _wmt14_names(split, lang, side)
            if split == "train":  # all three corpora, in a fixed order
                files[split][lang] = [_wmt14_find(raw_dir, n) or _wmt14_get(raw_dir, [n], split, lang) for n in names]
            else:  # the first of the alternative names that is there
                found = next((p for p in (_wmt14_find(raw_dir, n) for n in names) if p), None)
                files[split][lang] = found or _wmt14_get(raw_dir, names, split, lang)
    return files


DATASETS = {"multi30k": multi30k_files, "files": user_files, "wmt14": wmt14_files}
SGM_SEG = re.compile(r"<seg.*?>(.*)</seg>.*?")  # as sacreBLEU reads WMT .sgm test sets


def file_list(value) -> list[Path]:
    """One side of a split is a file or (WMT14 train) a list of files read one after the other."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _open_binary(path: Path):
    try:
        return gzip.open(path) if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from None


def iter_lines(path: Path):
    """Stream the stripped lines of a UTF-8 file (gzip if .gz), split on "\\n" only (other breaks would shift
    pairs); an .sgm file gives the text of its <seg> lines, whitespace collapsed, exactly as sacreBLEU does."""
    sgm = path.name.endswith((".sgm", ".sgm.gz"))
    try:
        with _open_binary(path) as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}: line {number} is not valid UTF-8 (byte {raw[e.start]:#04x}); "
                                    f"convert the file to UTF-8") from None
                if number == 1:
                    line = line.removeprefix("\ufeff")
                if not sgm:
                    yield line.strip()
                elif line.startswith("<seg "):
                    yield " ".join(SGM_SEG.sub(r"\1", line).split())
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def read_lines(path: Path) -> list[str]:
    """All lines of a (small) file, as iter_lines streams them."""
    return list(iter_lines(path))


def count_lines(path: Path) -> int:
    """Lines as iter_lines yields them, counted on the bytes (about 1 GB/s) so no text is decoded."""
    if path.name.endswith((".sgm", ".sgm.gz")):
        return sum(1 for _ in iter_lines(path))
    count, last = 0, b"\n"
    try:
        with _open_binary(path) as f:
            while chunk := f.read(1 << 22):
                count += chunk.count(b"\n")
                last = chunk[-1:]
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return count + (last != b"\n")
