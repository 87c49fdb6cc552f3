"""scripts/device_kit.py: the wheels a lent GPU machine lacks, cut to the corpora's languages."""

import base64
import gzip
import hashlib
import importlib.metadata
import importlib.util
import zipfile
from pathlib import Path

import msgpack
import pytest
import wordfreq

from pflbench.data import synth

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kit():
    spec = importlib.util.spec_from_file_location("device_kit", ROOT / "scripts" / "device_kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_package_of_the_kit_is_pinned_and_installed_here(kit):
    pins = kit.pinned(kit.PACKAGES)
    assert len(pins) == len(kit.PACKAGES) and all("==" in p for p in pins)
    for pin in pins:  # the pin is what this environment runs (constraints.txt is the lock)
        name, version = pin.split("==")
        assert importlib.metadata.version(name) == version, pin


def test_a_package_without_a_pin_is_refused(kit):
    with pytest.raises(SystemExit, match="no-such-package"):
        kit.pinned(["pydantic", "no-such-package"])


def _word_list(bands: list[list[str]]) -> bytes:
    return gzip.compress(msgpack.packb([{"format": "cB", "version": 1}, *bands]))


def _wheel(path: Path, files: list[str]) -> Path:
    record = "pkg.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as z:
        for name in files:
            z.writestr(
                name, _word_list([["a"]] * 10) if name.endswith(".msgpack.gz") else b"x" * 10
            )
        z.writestr(record, "\n".join(f"{n},sha256=abc,10" for n in files) + f"\n{record},,\n")
    return path


@pytest.mark.parametrize(
    "prefix, kept, dropped",
    [
        (
            "wordfreq-",
            ["wordfreq/__init__.py", "wordfreq/data/large_en.msgpack.gz",
             "wordfreq/data/small_fr.msgpack.gz", "wordfreq/data/large_de.msgpack.gz"],
            ["wordfreq/data/large_ru.msgpack.gz", "wordfreq/data/small_zh.msgpack.gz",
             "wordfreq/data/large_en_gb.msgpack.gz"],
        ),
        (
            "espeakng_loader-",
            ["espeakng_loader/espeak-ng-data/en_dict", "espeakng_loader/espeak-ng-data/de_dict",
             "espeakng_loader/espeak-ng-data/phondata", "espeakng_loader/libespeak-ng.so",
             "espeakng_loader/espeak-ng-data/lang/roa/fr"],
            ["espeakng_loader/espeak-ng-data/ru_dict", "espeakng_loader/espeak-ng-data/cmn_dict"],
        ),
    ],
)  # fmt: skip
def test_trimming_drops_only_the_other_languages_data(kit, tmp_path, prefix, kept, dropped):
    wheel = _wheel(tmp_path / f"{prefix}1.0-py3-none-any.whl", kept + dropped)
    kit.trim(wheel, kit.OTHER_LANGUAGES[prefix])
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("pkg.dist-info/RECORD").decode().splitlines()
    assert names == set(kept) | {"pkg.dist-info/RECORD"}
    assert {line.split(",")[0] for line in record} == set(kept) | {"pkg.dist-info/RECORD"}


def test_a_wheels_word_lists_are_cut_and_its_record_names_their_new_hashes(kit, tmp_path):
    lists = ["wordfreq/data/large_en.msgpack.gz", "wordfreq/data/small_en.msgpack.gz"]
    wheel = _wheel(tmp_path / "wordfreq-1.0-py3-none-any.whl", ["wordfreq/__init__.py", *lists])
    kit.trim(wheel, kit.OTHER_LANGUAGES["wordfreq-"])
    with zipfile.ZipFile(wheel) as z:
        record = {
            x.split(",")[0]: x.split(",")[1:]
            for x in z.read("pkg.dist-info/RECORD").decode().split()
        }
        for name in lists:
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert record[name] == [f"sha256={digest}", str(len(data))]
            assert (
                msgpack.unpackb(gzip.decompress(data))[1:] == [["a"]] * 10
            )  # fewer words than kept
    assert record["wordfreq/__init__.py"] == ["sha256=abc", "10"]


def test_the_cut_word_lists_give_the_synthetic_corpora_the_same_vocabularies(
    kit, tmp_path, monkeypatch
):
    """The device draws each language's vocabulary from the kit's cut lists: the same words."""

    def vocabularies():
        wordfreq.get_frequency_list.cache_clear()
        wordfreq.top_n_list.cache_clear()
        return {
            (language, n): synth.vocabulary(language, n)
            for language in kit.LANGUAGES
            for n in (synth.LS_VOCABULARY, synth.CV_VOCABULARY)
        }

    full = vocabularies()
    lists = [
        path
        for path in wordfreq.DATA_PATH.glob("*.msgpack.gz")
        if path.name.split(".")[0].split("_")
        in [[size, language] for size in ("large", "small") for language in kit.LANGUAGES]
    ]
    assert len(lists) == 2 * len(kit.LANGUAGES)
    for path in lists:
        (tmp_path / path.name).write_bytes(kit.cut_word_list(path.read_bytes()))
    cut, whole = (sum(p.stat().st_size for p in paths) for paths in (tmp_path.iterdir(), lists))
    assert cut < whole / 20, (cut, whole)
    monkeypatch.setattr(wordfreq, "DATA_PATH", tmp_path)
    try:
        assert vocabularies() == full
    finally:
        monkeypatch.undo()
        vocabularies()  # the caches hold the full lists' words again
