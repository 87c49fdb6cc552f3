"""The wheels a lent GPU machine needs to run pflbench (issue 26's GPU figures, the CUDA tests).

That machine's image holds PyTorch with CUDA, numpy, scipy, typer, rich, pyarrow, matplotlib and
more, but not the rest of pflbench's dependencies, and it cannot reach a package index: what it
lacks travels as wheels with the working tree, which may weigh 64 MiB in all (the tree itself is
~45 MB). This script downloads the pinned versions (constraints.txt) of the packages the image
lacks, for its Python (3.12, manylinux x86-64), into `.device/kit/` (ignored by git), with
wordfreq's word lists and espeak-ng's dictionaries cut to the languages the synthetic corpora
speak (wordfreq's wheel is 55 MB, its English, French and German lists 7; espeak-ng's Russian
dictionary alone is 8.5) and wordfreq's lists cut to the words the corpora draw from them, and
prints the kit's size beside the tree's.

Here:    .venv/bin/python scripts/device_kit.py   (pflbench's environment: it reads msgpack)
There:   bash scripts/device_figures.sh bench|tests   (the device tool's run, carry [".device"])
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import msgpack
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".device" / "kit"
# What pflbench (with its test extras) imports that the device image lacks, as last listed
# (../.library/device/KINDS.md, 2026-11-17), and the CLI's own stack (typer, click, rich: the
# image has other versions, and the command's parsing and output are what the tests check);
# the image's numerical packages (torch, numpy, scipy, ...) are used as they are.
PACKAGES = [
    "annotated-types", "audioread", "cffi", "click", "datasets", "decorator", "dill", "dm-tree",
    "dp-accounting", "espeakng-loader", "ftfy", "httpcore2", "httpx2", "jiwer", "lameenc",
    "langcodes", "librosa", "locate", "multiprocess", "opacus", "platformdirs", "pooch",
    "prv-accountant", "pycparser", "pydantic", "pydantic-core", "rapidfuzz", "rich", "soundfile",
    "soxr", "truststore", "typer", "typing-inspection", "tzdata", "unidecode", "wcwidth",
    "wordfreq",
]  # fmt: skip
# The synthetic corpora's languages (data.synth): wordfreq's lists of the others stay behind.
LANGUAGES = ("en", "fr", "de")
PLATFORMS = [
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux1_x86_64",
]  # fmt: skip
# What may travel with one call, tree and carried paths together: 64 MiB by the tool's README,
# but it refused 63.1 MiB (the tree and this kit) on 2026-11-27 and took 56.3, so 60 is the
# bound checked here.
LIMIT = 60 * 2**20


def pinned(names: list[str]) -> list[str]:
    """name==version for each name, from constraints.txt (names compared as pip normalizes)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    absent = [n for n in names if canonicalize_name(n) not in pins]
    if absent:
        sys.exit(f"constraints.txt pins no version of {', '.join(absent)}")
    return [f"{n}=={pins[canonicalize_name(n)]}" for n in names]


# Per wheel, the files of other languages: wordfreq's word lists, espeak-ng's dictionaries.
OTHER_LANGUAGES = {
    "wordfreq-": r"wordfreq/data/(?!.*_({})\.msgpack\.gz$)",
    "espeakng_loader-": r"espeakng_loader/espeak-ng-data/(?!({})_dict$)[a-z_]+_dict$",
}


# wordfreq's lists of those languages: the corpora's vocabularies are the top few hundred words of
# each (data.synth.vocabulary), so a list keeps only its first frequency bands, WORDS_KEPT words,
# some KB instead of 1.5-3.6 MB; tests/test_device_kit.py checks the vocabularies drawn from the
# cut lists are the full lists' own.
WORD_LISTS = re.compile(r"wordfreq/data/\w+\.msgpack\.gz$")
WORDS_KEPT = 4000


def cut_word_list(data: bytes, words: int = WORDS_KEPT) -> bytes:
    """A wordfreq list (gzipped msgpack: a header, then one list of words per frequency band, the
    most frequent first) cut after the first bands that hold `words` words."""
    header, *bands = msgpack.unpackb(gzip.decompress(data), raw=False)
    kept, count = [], 0
    for band in bands:
        if count >= words:
            break
        kept.append(band)
        count += len(band)
    return gzip.compress(msgpack.packb([header, *kept], use_bin_type=True), mtime=0)


def _record(record: bytes, drop: re.Pattern, rewritten: dict[str, bytes]) -> bytes:
    """A wheel's RECORD (path,hash,size per line) without the dropped files' lines and with the
    rewritten files' hashes and sizes: pip checks a wheel's files against it."""
    lines = []
    for line in record.decode().splitlines():
        name = line.split(",")[0]
        if name in rewritten:
            digest = hashlib.sha256(rewritten[name]).digest()
            line = f"{name},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},"
            line += str(len(rewritten[name]))
        if not drop.match(name):
            lines.append(line)
    return "\n".join(lines).encode() + b"\n"


def trim(wheel: Path, pattern: str) -> None:
    """Rewrite a wheel without the files `pattern` matches and with its word lists cut."""
    drop = re.compile(pattern.format("|".join(LANGUAGES)))
    with zipfile.ZipFile(wheel) as src:
        files = {i.filename: (i, src.read(i)) for i in src.infolist() if not drop.match(i.filename)}
    rewritten = {
        name: cut_word_list(data) for name, (_, data) in files.items() if WORD_LISTS.match(name)
    }
    with tempfile.NamedTemporaryFile(dir=wheel.parent, delete=False) as tmp:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for name, (item, data) in files.items():
                if name.endswith(".dist-info/RECORD"):
                    data = _record(data, drop, rewritten)
                dst.writestr(item, rewritten.get(name, data))
    Path(tmp.name).replace(wheel)


def tree_bytes() -> int:
    """Bytes of what the device tool sends: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = [ROOT / p.decode() for p in listed if p]
    return sum(path.stat().st_size for path in paths if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the device's Python")
    args = parser.parse_args()
    KIT.mkdir(parents=True, exist_ok=True)
    for old in KIT.glob("*.whl"):
        old.unlink()
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", args.python_version, "--implementation", "cp", *platforms,
         "-d", str(KIT), *pinned(PACKAGES)],
        check=True,
    )  # fmt: skip
    for prefix, pattern in OTHER_LANGUAGES.items():
        for wheel in KIT.glob(f"{prefix}*.whl"):
            trim(wheel, pattern)
    wheels = list(KIT.glob("*.whl"))
    kit = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    print(f"{len(wheels)} wheels, {kit / 2**20:.1f} MiB in {KIT.relative_to(ROOT)}")
    together, limit = (kit + tree) / 2**20, LIMIT / 2**20
    print(f"working tree {tree / 2**20:.1f} MiB; together {together:.1f} of {limit:.0f} MiB")
    if kit + tree > LIMIT:
        sys.exit(f"over {limit:.0f} MiB: the device tool would refuse the call")


if __name__ == "__main__":
    main()
