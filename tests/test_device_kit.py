"""scripts/device_kit.py: the wheels a lent GPU machine lacks, cut to the corpora's languages."""

import importlib.metadata
import importlib.util
import zipfile
from pathlib import Path

import pytest

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


def _wheel(path: Path, files: list[str]) -> Path:
    record = "pkg.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as z:
        for name in files:
            z.writestr(name, b"x" * 10)
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
