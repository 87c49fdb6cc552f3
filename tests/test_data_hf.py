"""Hugging Face datasets (save_to_disk folders, Hub-layout Parquet), written with the `datasets`
library in the Hub schemas of openslr/librispeech_asr and mozilla-foundation/common_voice_13_0,
give the same data as the native LibriSpeech / Common Voice folders they were made from."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.data.adapters import CORPORA
from pflbench.data.corpora import Skips
from pflbench.data.hf import read_hf_audio
from pflbench.data.prepare import prepare_task, source_manifest, subset_manifest
from pflbench.data.synth import CV_RELEASE
from pflbench.errors import UserError
from pflbench.results.record import data_info
from pflbench.spec.models import DataSource, EvalSet, Task
from pflbench.spec.registry import load_registry

AUDIO = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}  # cast to Audio
STRING, INT = datasets.Value("string"), datasets.Value("int64")
LS_SCHEMA = {  # openslr/librispeech_asr; audio: Audio(sampling_rate=16000)
    "file": STRING, "audio": AUDIO, "text": STRING, "speaker_id": INT, "chapter_id": INT,
    "id": STRING,
}  # fmt: skip
CV_SCHEMA = {  # mozilla-foundation/common_voice_13_0; audio: Audio(sampling_rate=48000)
    "client_id": STRING, "path": STRING, "audio": AUDIO, "sentence": STRING, "up_votes": INT,
    "down_votes": INT, "age": STRING, "gender": STRING, "accent": STRING, "locale": STRING,
    "segment": STRING, "variant": STRING,
}  # fmt: skip
LS_SUBSETS = {  # tiny corpus subset -> its split in the configs "all" and "clean"
    "train-clean-100": ("train.clean.100", "train.100"),
    "dev-clean": ("validation.clean", "validation"),
    "test-clean": ("test.clean", "test"),
}
CV_SPLITS = {"train": "train", "dev": "validation", "test": "test"}
CV_VOTES = ("up_votes", "down_votes")


def librispeech_rows(subset_dir: Path, decoded: bool = False) -> dict[str, list]:
    """The openslr/librispeech_asr columns of a native subset folder."""
    cols: dict[str, list] = {name: [] for name in LS_SCHEMA}
    for trans in sorted(subset_dir.glob("*/*/*.trans.txt")):
        for line in trans.read_text().splitlines():
            utt, text = line.split(" ", 1)
            flac = trans.parent / f"{utt}.flac"
            speaker, chapter, _ = utt.split("-")
            cols["file"].append(flac.name)
            cols["audio"].append(audio_value(flac, decoded))
            cols["text"].append(text)
            cols["speaker_id"].append(int(speaker))
            cols["chapter_id"].append(int(chapter))
            cols["id"].append(utt)
    return cols


def commonvoice_rows(locale_dir: Path, split: str, decoded: bool = False) -> dict[str, list]:
    """The Common Voice dataset columns of a native release split (its loader renames `accents`
    to `accent` and reads `path` from the split's archive)."""
    with (locale_dir / f"{split}.tsv").open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    cols = {name: [r.get(name) for r in rows] for name in CV_SCHEMA}
    cols["path"] = [f"{locale_dir.name}_{split}_0/{r['path']}" for r in rows]
    cols["audio"] = [audio_value(locale_dir / "clips" / r["path"], decoded) for r in rows]
    cols["up_votes"], cols["down_votes"] = ([int(r[c]) for r in rows] for c in CV_VOTES)
    cols["accent"] = [r["accents"] for r in rows]
    return cols


def audio_value(path: Path, decoded: bool) -> dict:
    if decoded:
        wave, rate = sf.read(path, dtype="float32")
        return {"array": wave, "sampling_rate": rate}
    return {"bytes": path.read_bytes(), "path": path.name}


def hub_dataset(cols: dict, schema: dict, rate: int, config: str | None) -> datasets.Dataset:
    """A Dataset in a Hub schema, audio cast to Audio as load_dataset gives it; decoded
    {array, sampling_rate} cells are kept as they are."""
    info = datasets.DatasetInfo(config_name=config)
    if "array" in cols["audio"][0]:
        return datasets.Dataset.from_dict(cols, info=info)
    info.features = datasets.Features(schema)
    ds = datasets.Dataset.from_dict(cols, info=info)
    return ds.cast_column("audio", datasets.Audio(sampling_rate=rate))


def save_to_disk(splits: dict[str, datasets.Dataset], folder: Path) -> None:
    """`load_dataset(name, config).save_to_disk(folder)`: one folder per split."""
    datasets.DatasetDict(splits).save_to_disk(str(folder))


def to_parquet(ds: datasets.Dataset, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path), batch_size=7)  # several row groups per file


def ls_split(ls: Path, subset: str, config: str | None = "all") -> datasets.Dataset:
    return hub_dataset(librispeech_rows(ls / subset), LS_SCHEMA, 16000, config)


def cv_split(cv: Path, split: str, decoded: bool = False) -> datasets.Dataset:
    return hub_dataset(commonvoice_rows(cv, split, decoded), CV_SCHEMA, 48000, "en")


def native_dirs(tiny_corpus_root: Path) -> tuple[Path, Path]:
    return tiny_corpus_root / "LibriSpeech", tiny_corpus_root / CV_RELEASE / "en"


@pytest.fixture(scope="module")
def hf_root(tiny_corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpora as Hugging Face users have them, one layout per split (no SPEAKERS.TXT)."""
    root = tmp_path_factory.mktemp("hf")
    ls, cv = native_dirs(tiny_corpus_root)
    ls_hf, cv_hf = root / "librispeech_asr", root / "common_voice_13_0"
    to_parquet(ls_split(ls, "train-clean-100", "clean"),
               ls_hf / "clean" / "train.100-00000-of-00001.parquet")  # fmt: skip
    # load_dataset(..., "clean").save_to_disk(D): D/validation/, clean only per dataset_info.json
    save_to_disk({"validation": ls_split(ls, "dev-clean", "clean")}, ls_hf)
    to_parquet(cv_split(cv, "train"), cv_hf / "en" / "train-00000-of-00001.parquet")
    save_to_disk({"validation": cv_split(cv, "dev", decoded=True)}, cv_hf / "en")
    to_parquet(cv_split(cv, "test"), cv_hf / "en" / "test" / "0000.parquet")
    return root


@pytest.fixture(scope="module")
def hub_download_root(tiny_corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full Hub download of openslr/librispeech_asr (every split under "all" and again under
    "clean", <config>/<split>/0000.parquet) with LibriSpeech's SPEAKERS.TXT beside it, and
    `load_dataset("mozilla-foundation/common_voice_13_0", "en").save_to_disk(...)`."""
    root = tmp_path_factory.mktemp("hub")
    ls, cv = native_dirs(tiny_corpus_root)
    for subset, splits in LS_SUBSETS.items():
        for config, split in zip(("all", "clean"), splits, strict=True):
            to_parquet(ls_split(ls, subset, config),
                       root / "librispeech_asr" / config / split / "0000.parquet")  # fmt: skip
    shutil.copy(ls / "SPEAKERS.TXT", root / "librispeech_asr" / "SPEAKERS.TXT")
    save_to_disk({hf: cv_split(cv, split) for split, hf in CV_SPLITS.items()},
                 root / "common_voice_13_0")  # fmt: skip
    return root


@pytest.fixture(scope="module")
def saved_ls_root(tiny_corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "clean" config of LibriSpeech saved whole with no config_name in its dataset_info.json
    (its split names say the config) with SPEAKERS.TXT, and Common Voice in push_to_hub's Parquet
    layout <locale>/<split>-00000-of-00001.parquet."""
    root = tmp_path_factory.mktemp("saved")
    ls, cv = native_dirs(tiny_corpus_root)
    save_to_disk({clean: ls_split(ls, subset, None) for subset, (_, clean) in LS_SUBSETS.items()},
                 root / "librispeech_asr")  # fmt: skip
    shutil.copy(ls / "SPEAKERS.TXT", root / "librispeech_asr" / "SPEAKERS.TXT")
    for split, hf in CV_SPLITS.items():
        to_parquet(cv_split(cv, split),
                   root / "common_voice_13_0" / "en" / f"{hf}-00000-of-00001.parquet")  # fmt: skip
    return root


def assert_same_store(a, b) -> None:
    assert a.users() == b.users()
    assert a.stats() == b.stats()
    for x, y in zip(a, b, strict=True):
        assert (x.utt_id, x.user_id, x.text) == (y.utt_id, y.user_id, y.text)
        assert np.array_equal(x.feats, y.feats) and np.array_equal(x.tokens, y.tokens)


def figures(report: dict, splits: list[str] | None = None) -> dict:
    """What `pflbench data stats` must give alike for a corpus's native folders and its Hugging
    Face datasets: per split, users, utterances, hours and speakers per group."""
    keys = ("users", "utterances", "hours", "speaker_groups")
    return {split: {k: report[split][k] for k in keys} for split in splits or report}


def test_hf_datasets_give_the_native_data(
    hf_root: Path, tiny_task: Task, tiny_task_data, tmp_path: Path
) -> None:
    task = tiny_task.model_copy(update={"synthetic": None})
    hf = prepare_task(task, data_root=hf_root, cache_dir=tmp_path, progress=False)
    assert_same_store(hf.seed_train, tiny_task_data.seed_train)  # Parquet, {bytes, path}
    assert_same_store(hf.federated_train, tiny_task_data.federated_train)
    for name in ("cv-dev", "cv-test", "ls-dev-clean"):  # save_to_disk ({array, rate}), Parquet
        assert_same_store(hf.eval_sets[name], tiny_task_data.eval_sets[name])
    # Common Voice's age, gender and accent columns give the native speaker groups...
    for name in ("cv-dev", "cv-test"):
        assert hf.eval_groups[name] == tiny_task_data.eval_groups[name]
        assert set(hf.eval_groups[name]) == {"accent", "age", "gender"}
    # ...openslr/librispeech_asr has none: without SPEAKERS.TXT, the report and record say why.
    assert set(tiny_task_data.eval_groups["ls-dev-clean"]) == {"gender"}
    assert hf.eval_groups["ls-dev-clean"] == {}
    why = hf.report["eval:ls-dev-clean"]["speaker_groups_unavailable"]
    assert "no speaker attributes" in why and "librispeech_asr/SPEAKERS.TXT is missing" in why
    sources = data_info(hf, None).sources
    assert sources["eval:ls-dev-clean"]["speaker_groups_unavailable"] == why
    assert "speaker_groups_unavailable" not in sources["eval:cv-dev"]
    assert sources["eval:cv-dev"]["read_from"] == {
        "dev": "Hugging Face common_voice_13_0/en/validation (save_to_disk, config 'en')"
    }


def data_stats(task: str, root: Path, *options: str) -> dict:
    result = CliRunner().invoke(
        app, ["data", "stats", "--task", task, "--data-root", str(root), "--json", *options]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("layout", ["hub_download_root", "saved_ls_root"])
def test_data_stats_of_hf_datasets_equal_the_native_folders(
    layout: str, request, tiny_task: Task, tiny_task_data, tmp_path: Path, monkeypatch
) -> None:
    root = request.getfixturevalue(layout)
    (tmp_path / "specs" / "tasks").mkdir(parents=True)
    spec = tiny_task.model_dump(mode="json", exclude_none=True, exclude={"recipe", "synthetic"})
    (tmp_path / "specs" / "tasks" / f"{tiny_task.name}.yaml").write_text(json.dumps(spec))
    monkeypatch.setenv("PFLBENCH_CACHE", str(tmp_path / "cache"))
    report = data_stats(tiny_task.name, root, "--specs", str(tmp_path / "specs"))
    assert figures(report) == figures(tiny_task_data.report)  # SPEAKERS.TXT in the dataset
    assert report["eval:ls-dev-clean"]["speaker_groups"]["gender"]
    read_from = {split: r["read_from"] for split, r in report.items()}
    if layout == "hub_download_root":  # both configs: "all" read, and the report says so
        rows = len(tiny_task_data.seed_train)
        assert read_from["seed"] == {"train-clean-100": (
            "Hugging Face librispeech_asr/all/train.clean.100 (Parquet, 1 file(s), config 'all'; "
            f"config 'clean' holds the same split ({rows} rows), not read)"
        )}  # fmt: skip
    else:  # "clean" saved without config_name: validation/ is dev-clean as train.100/ is beside it
        assert read_from["eval:ls-dev-clean"] == {
            "dev-clean": "Hugging Face librispeech_asr/validation (save_to_disk, config 'clean')"
        }
        assert read_from["federated"] == {
            "train": "Hugging Face common_voice_13_0/en (Parquet, 1 file(s), config 'en')"
        }


def test_cv_en_ls100_seed_prepares_from_a_hub_download_beside_common_voice(
    hub_download_root: Path, tiny_task_data, tmp_path: Path
) -> None:
    """The paper's headline task from a full openslr/librispeech_asr download and a Common Voice
    save_to_disk folder under one data root, per-group WER intact."""
    task = load_registry().task("cv-en-ls100-seed").spec
    data = prepare_task(task, data_root=hub_download_root, cache_dir=tmp_path, progress=False)
    splits = ["seed", "federated", "eval:cv-dev", "eval:cv-test"]
    assert figures(data.report) == figures(tiny_task_data.report, splits)
    assert data.eval_groups == {name: tiny_task_data.eval_groups[name] for name in data.eval_groups}
    assert all(set(groups) == {"accent", "age", "gender"} for groups in data.eval_groups.values())
    sources = data_info(data, None).sources  # the record says which config was read
    assert (
        "config 'all'; config 'clean' holds the same split"
        in (sources["seed"]["read_from"]["train-clean-100"])
    )
    assert not any("speaker_groups_unavailable" in s for s in sources.values())


# Where each registered corpus's Hugging Face counterpart lies in hf_root (one layout each).
HF_CASES = {
    "librispeech": ("dev-clean", "en", ["librispeech_asr/validation"]),  # save_to_disk, "clean"
    "commonvoice": ("test", "en", ["common_voice_13_0/en/test/0000.parquet"]),  # <split>/*.parquet
}


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_each_corpus_adapter_finds_its_hugging_face_counterpart(
    corpus: str, hf_root: Path, tmp_path: Path
) -> None:
    adapter = CORPORA[corpus]
    subset, locale, parts = HF_CASES[corpus]
    assert adapter.find(hf_root, subset, locale) is None  # no native copy: HF is next
    found = adapter.find_hf(hf_root, subset, locale)
    assert found.parts == [hf_root / p for p in parts]
    manifest = adapter.read_hf(found, subset, "en", Skips())
    entries = manifest.entries
    assert entries and {(e.corpus, e.split) for e in entries} == {(corpus, subset)}
    assert all(e.audio.startswith(f"hf:{hf_root}/") for e in entries)
    assert manifest == subset_manifest(hf_root, corpus, subset, locale, "en", Skips())
    assert adapter.find_hf(tmp_path, subset, locale) is None
    assert str(tmp_path) in adapter.looked_for_hf(tmp_path, subset, locale)[0]


def not_found(root: Path, corpus: str, subset: str, locale: str | None = None) -> str:
    with pytest.raises(UserError, match="not found") as raised:
        subset_manifest(root, corpus, subset, locale, "en", Skips())
    return str(raised.value)


def test_missing_hf_splits_say_what_was_tried_and_found_instead(
    hf_root: Path, tiny_corpus_root: Path, tmp_path: Path
) -> None:
    ls, cv = native_dirs(tiny_corpus_root)
    message = not_found(hf_root, "librispeech", "test-other")
    for layout in ("all/test.other/ (save_to_disk or *.parquet)", "all/test.other-*.parquet",
                   "other/test/ (save_to_disk or *.parquet)", "other/test-*.parquet",
                   "test/ (save_to_disk of config other)"):  # fmt: skip
        assert layout in message
    assert message.endswith(
        f"found instead: {hf_root}/librispeech_asr holds clean/ (train.100-00000-of-00001.parquet),"
        " validation/ (save_to_disk, config 'clean')"
    )
    # validation/ of no config, alone, could be clean or other: not taken, and shown as the miss.
    save_to_disk({"validation": ls_split(ls, "dev-clean", None)}, tmp_path / "librispeech_asr")
    message = not_found(tmp_path, "librispeech", "dev-clean")
    assert message.endswith(f"found instead: {tmp_path}/librispeech_asr holds validation/ "
                            "(save_to_disk, no config_name)")  # fmt: skip
    # Common Voice in another locale.
    to_parquet(cv_split(cv, "test"), tmp_path / "common_voice_13_0" / "fr" / "test" / "0.parquet")
    message = not_found(tmp_path, "commonvoice", "test", "en")
    assert message.endswith(f"found instead: {tmp_path}/common_voice_13_0 holds fr/ (test/)")


def test_two_configs_or_two_datasets_holding_a_split(hub_download_root: Path, tmp_path: Path):
    ls = tmp_path / "one" / "librispeech_asr"
    shutil.copytree(hub_download_root / "librispeech_asr", ls)
    found = CORPORA["librispeech"].find_hf(tmp_path / "one", "dev-clean", "en")
    assert (found.config, found.split) == ("all", "validation.clean")
    # An incomplete copy of one config is not passed over silently.
    part = ls / "clean" / "validation" / "0000.parquet"
    pq.write_table(pq.read_table(part).slice(1), part)
    with pytest.raises(
        UserError,
        match=r"dev-clean: the configs of .*librispeech_asr hold differ"
        r"ent numbers of rows \(\d+ in config 'all', \d+ in config 'clean'\)",
    ):
        CORPORA["librispeech"].find_hf(tmp_path / "one", "dev-clean", "en")
    # The same split in two dataset folders.
    two = tmp_path / "two"
    for name in ("common_voice_a", "common_voice_b"):
        shutil.copytree(hub_download_root / "common_voice_13_0", two / name)
    with pytest.raises(UserError, match="more than one Hugging Face dataset folder under"):
        subset_manifest(two, "commonvoice", "train", "en", "en", Skips())


def test_hf_bad_rows_are_skipped_and_counted(
    hf_root: Path, tiny_task: Task, tmp_path: Path
) -> None:
    good = pq.read_table(next((hf_root / "common_voice_13_0" / "en").glob("train-*.parquet")))
    rows = good.slice(0, 3).to_pylist()
    first = rows[0]
    audio = first["audio"]["bytes"]
    bad = [
        {**first, "path": "en/null_audio.mp3", "audio": None},
        {**first, "path": "en/corrupt.mp3", "audio": {"bytes": b"ID3" + bytes(300), "path": None}},
        {**first, "path": "en/truncated.mp3", "audio": {"bytes": audio[:400], "path": None}},
        {**first, "path": "en/empty_bytes.mp3", "audio": {"bytes": b"", "path": None}},
        {**first, "path": "en/no_text.mp3", "sentence": None},
        {**first, "path": "en/no_user.mp3", "client_id": None},
        {**first, "path": "en/digits.mp3", "sentence": "1234"},
        rows[1],  # a duplicate clip
    ]
    table = pa.Table.from_pylist(rows + bad, schema=good.schema)
    (tmp_path / "data" / "common_voice" / "en").mkdir(parents=True)
    pq.write_table(table, tmp_path / "data" / "common_voice" / "en" / "validation-0.parquet")
    dev = DataSource(corpus="commonvoice", subsets=["dev"], locale="en")
    task = tiny_task.model_copy(
        update={"synthetic": None, "seed_data": None, "federated_data": dev, "eval_sets": []}
    )
    data = prepare_task(task, data_root=tmp_path / "data", cache_dir=tmp_path, progress=False)
    skipped = data.report["federated"]["skipped"]
    assert skipped["examples"]["missing_audio_file"] == ["null_audio"]
    assert skipped["examples"]["zero_length_audio"] == ["empty_bytes"]
    assert set(skipped["examples"]["unreadable_audio"] + skipped["examples"].get(
        "truncated_audio", [])) == {"corrupt", "truncated"}  # fmt: skip
    assert skipped["examples"]["empty_transcript"] == ["no_text"]
    assert skipped["examples"]["missing_user_id"] == ["no_user"]
    assert skipped["examples"]["characters_outside_token_set"] == ["digits"]
    assert skipped["examples"]["duplicate_utterance"] == [Path(rows[1]["path"]).stem]
    assert len(data.federated_train) == 3
    # A file without the needed columns is an error naming it.
    (tmp_path / "cols" / "common_voice" / "en").mkdir(parents=True)
    pq.write_table(pa.table({"path": ["a.mp3"], "audio": [None]}),
                   tmp_path / "cols" / "common_voice" / "en" / "train-0.parquet")  # fmt: skip
    with pytest.raises(UserError, match=r"train-0\.parquet.*client_id, sentence"):
        subset_manifest(tmp_path / "cols", "commonvoice", "train", "en", "en", Skips())


# ----------------------------------------------------------------------------------------------
# Columns of other types, cells without a rate, corrupt pages: small Parquet files written here.

ENCODED = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
DECODED = pa.struct([("array", pa.list_(pa.float32())), ("sampling_rate", pa.int64())])
TONE = 0.1 * np.sin(np.linspace(0, 200 * np.pi, 8000))  # half a second at 16 kHz


def flac_bytes() -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, TONE, 16000, format="FLAC")
    return buffer.getvalue()


def cv_columns() -> dict[str, pa.Array]:
    """Two Common Voice rows as the Hub dataset has them, audio encoded."""
    return {
        "client_id": pa.array(["speaker0", "speaker1"]),
        "path": pa.array(["en_validation_0/one.mp3", "en_validation_0/two.mp3"]),
        "sentence": pa.array(["Hello there.", "Good day."]),
        "audio": pa.array([{"bytes": flac_bytes(), "path": None}] * 2, ENCODED),
    }


def write_cv_parquet(root: Path, columns: dict, split: str = "validation") -> Path:
    path = root / "common_voice" / "en" / f"{split}-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, compression="none", use_dictionary=False)
    return path


WRONG_TYPES = {  # case -> (columns replaced, what the error says)
    "audio as a path string": (
        {"audio": pa.array(["clips/one.mp3", "clips/two.mp3"])},
        "column 'audio' is string, expected struct<bytes: binary, path: string>",
    ),
    "stereo arrays": (
        {
            "audio": pa.array(
                [{"array": [TONE.tolist()] * 2, "sampling_rate": 16000}] * 2,
                pa.struct(
                    [("array", pa.list_(pa.list_(pa.float32()))), ("sampling_rate", pa.int64())]
                ),
            )
        },  # fmt: skip
        "column 'audio' is struct<array: list<element: list<element: float>>, sampling_rate: "
        "int64>, expected",
    ),
    "integer paths": ({"path": pa.array([1, 2])}, "column 'path' is int64, expected string"),
    "sentences as lists": (
        {"sentence": pa.array([["Hello there."], ["Good day."]])},
        "column 'sentence' is list<element: string>, expected string",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_hf_columns_of_another_type_are_errors_naming_them(case: str, tmp_path: Path) -> None:
    replaced, message = WRONG_TYPES[case]
    part = write_cv_parquet(tmp_path, {**cv_columns(), **replaced})
    with pytest.raises(UserError) as raised:
        subset_manifest(tmp_path, "commonvoice", "dev", "en", "en", Skips())
    assert str(raised.value).startswith(f"{part}: {message}")


def test_hf_librispeech_ids_of_another_type_are_an_error(tmp_path: Path) -> None:
    part = tmp_path / "librispeech_asr" / "all" / "validation.clean" / "0000.parquet"
    part.parent.mkdir(parents=True)
    columns = {"id": [1070_8901_0000], "speaker_id": [1070], "text": ["HELLO THERE"],
               "audio": pa.array([{"bytes": flac_bytes(), "path": None}], ENCODED)}  # fmt: skip
    pq.write_table(pa.table(columns), part)
    with pytest.raises(UserError, match=r"0000\.parquet: column 'id' is int64, expected string"):
        subset_manifest(tmp_path, "librispeech", "dev-clean", None, "en", Skips())


@pytest.mark.parametrize(
    ("cell", "reason"),
    [
        ({"array": TONE.tolist(), "sampling_rate": None}, "missing_sample_rate"),
        # decoded samples get a file's checks (audio.py)
        ({"array": TONE.tolist(), "sampling_rate": 1}, "implausible_sample_rate"),
        ({"array": [*TONE.tolist()[:-1], float("nan")], "sampling_rate": 16000}, "nonfinite_audio"),
        ({"array": (1e30 * TONE).tolist(), "sampling_rate": 16000}, "implausible_amplitude"),
    ],
)
def test_a_bad_decoded_cell_is_skipped_and_counted(tmp_path: Path, cell: dict, reason: str) -> None:
    cells = [{"array": TONE.tolist(), "sampling_rate": 16000}, cell]
    for split in ("train", "validation"):
        write_cv_parquet(tmp_path / "data", {**cv_columns(), "audio": pa.array(cells, DECODED)},
                         split)  # fmt: skip
    dev = EvalSet(name="dev", corpus="commonvoice", subset="dev", locale="en", role="dev")
    task = Task(
        name="hf-rates", version=1, language="en", description="", eval_sets=[dev],
        federated_data=DataSource(corpus="commonvoice", subsets=["train"], locale="en"),
    )  # fmt: skip
    data = prepare_task(task, data_root=tmp_path / "data", cache_dir=tmp_path, progress=False)
    for split in ("federated", "eval:dev"):
        assert data.report[split]["skipped"] == {
            "counts": {reason: 1},
            "examples": {reason: ["two"]},
        }
    assert data.federated_train.users() == data.eval_sets["dev"].users() == ["speaker0"]


def test_a_clip_in_two_hf_splits_of_a_source_is_read_once(tmp_path: Path) -> None:
    write_cv_parquet(tmp_path, cv_columns(), "train")
    write_cv_parquet(tmp_path, cv_columns(), "validation")
    skips = Skips()
    source = DataSource(corpus="commonvoice", subsets=["train", "dev"], locale="en")
    entries, _, _ = source_manifest(tmp_path, source, "en", skips)
    assert [(e.utt_id, e.split) for e in entries] == [("one", "train"), ("two", "train")]
    assert skips.counts == {"duplicate_utterance": 2}


def corrupt_column(part: Path, column: str) -> None:
    """Overwrites the header of the column's first data page (the footer stays intact)."""
    meta = pq.ParquetFile(part).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema == column)  # fmt: skip
    data = bytearray(part.read_bytes())
    data[chunk.data_page_offset : chunk.data_page_offset + 16] = b"\xff" * 16
    part.write_bytes(bytes(data))


def test_corrupt_parquet_text_pages_are_an_error_naming_the_file(tmp_path: Path) -> None:
    part = write_cv_parquet(tmp_path / "text", cv_columns())
    corrupt_column(part, "sentence")
    with pytest.raises(UserError, match=f"^{part}: not a readable Hugging Face dataset"):
        subset_manifest(tmp_path / "text", "commonvoice", "dev", "en", "en", Skips())


def test_corrupt_parquet_audio_pages_are_an_error_naming_the_file_and_rows(tmp_path: Path) -> None:
    # Met when features are made, not when the manifest is read.
    part = write_cv_parquet(tmp_path / "audio", cv_columns())
    corrupt_column(part, "audio.bytes")
    entries = subset_manifest(tmp_path / "audio", "commonvoice", "dev", "en", "en", Skips()).entries
    assert len(entries) == 2
    with pytest.raises(UserError, match=rf"^{part}: the audio of rows 0-1 \(row group 0\) is not"):
        read_hf_audio(entries[1].audio)
