"""Hugging Face datasets (save_to_disk folders, Hub-layout Parquet) give the same data as the
native LibriSpeech / Common Voice formats they were made from."""

from __future__ import annotations

import csv
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pflbench.data.adapters import CORPORA
from pflbench.data.corpora import Skips
from pflbench.data.prepare import prepare_task, subset_manifest
from pflbench.data.synth import CV_RELEASE
from pflbench.errors import UserError
from pflbench.spec.models import DataSource, Task


def librispeech_rows(subset_dir: Path, decoded: bool = False) -> dict[str, list]:
    """The openslr/librispeech_asr columns of a native subset folder."""
    names = ("file", "audio", "text", "speaker_id", "chapter_id", "id")
    cols: dict[str, list] = {name: [] for name in names}
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
    """The Common Voice dataset columns of a native release split."""
    with (locale_dir / f"{split}.tsv").open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return {
        "client_id": [r["client_id"] for r in rows],
        "path": [f"{locale_dir.name}_{split}_0/{r['path']}" for r in rows],
        "audio": [audio_value(locale_dir / "clips" / r["path"], decoded) for r in rows],
        "sentence": [r["sentence"] for r in rows],
        "locale": [locale_dir.name] * len(rows),
    }


def audio_value(path: Path, decoded: bool) -> dict:
    if decoded:
        wave, rate = sf.read(path, dtype="float32")
        return {"array": wave, "sampling_rate": rate}
    return {"bytes": path.read_bytes(), "path": path.name}


def save_to_disk(cols: dict, folder: Path, config: str | None = None, split: str | None = None):
    ds = datasets.Dataset.from_dict(cols, info=datasets.DatasetInfo(config_name=config))
    if "bytes" in cols["audio"][0]:
        ds = ds.cast_column("audio", datasets.Audio())
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(folder))


def write_parquet(cols: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=7)  # several row groups per file


@pytest.fixture(scope="module")
def hf_root(tiny_corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpora as Hugging Face users have them, one layout per split."""
    root = tmp_path_factory.mktemp("hf")
    ls, cv = tiny_corpus_root / "LibriSpeech", tiny_corpus_root / CV_RELEASE / "en"
    ls_hf, cv_hf = root / "librispeech_asr", root / "common_voice_13_0"
    write_parquet(librispeech_rows(ls / "train-clean-100"),
                  ls_hf / "clean" / "train.100-00000-of-00001.parquet")  # fmt: skip
    # load_dataset(..., "clean").save_to_disk(D): D/validation/, clean only per dataset_info.json
    save_to_disk(librispeech_rows(ls / "dev-clean"), ls_hf, config="clean", split="validation")
    write_parquet(commonvoice_rows(cv, "train"), cv_hf / "en" / "train-00000-of-00001.parquet")
    save_to_disk(commonvoice_rows(cv, "dev", decoded=True), cv_hf / "en" / "validation")
    write_parquet(commonvoice_rows(cv, "test"), cv_hf / "en" / "test" / "0000.parquet")
    return root


def assert_same_store(a, b) -> None:
    assert a.users() == b.users()
    assert a.stats() == b.stats()
    for x, y in zip(a, b, strict=True):
        assert (x.utt_id, x.user_id, x.text) == (y.utt_id, y.user_id, y.text)
        assert np.array_equal(x.feats, y.feats) and np.array_equal(x.tokens, y.tokens)


def test_hf_datasets_give_the_native_data(
    hf_root: Path, tiny_task: Task, tiny_task_data, tmp_path: Path
) -> None:
    task = tiny_task.model_copy(update={"synthetic": None})
    hf = prepare_task(task, data_root=hf_root, cache_dir=tmp_path, progress=False)
    assert_same_store(hf.seed_train, tiny_task_data.seed_train)  # Parquet, {bytes, path}
    assert_same_store(hf.federated_train, tiny_task_data.federated_train)
    for name in ("cv-dev", "cv-test", "ls-dev-clean"):  # save_to_disk ({array, rate}), Parquet
        assert_same_store(hf.eval_sets[name], tiny_task_data.eval_sets[name])


def test_hf_manifest_matches_native(hf_root: Path, tiny_corpus_root: Path) -> None:
    for corpus, subset, locale in (
        ("librispeech", "dev-clean", None),
        ("commonvoice", "dev", "en"),
    ):
        native = subset_manifest(tiny_corpus_root, corpus, subset, locale, "en", Skips())
        hf = subset_manifest(hf_root, corpus, subset, locale, "en", Skips())
        strip = [(e.utt_id, e.user_id, e.split, e.raw_text, e.text, e.corpus) for e in native]
        assert strip == [(e.utt_id, e.user_id, e.split, e.raw_text, e.text, e.corpus) for e in hf]
        assert all(e.audio.startswith("hf:") for e in hf)


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
    assert found == [hf_root / p for p in parts]
    entries = adapter.read_hf(found, subset, "en", Skips())
    assert entries and {(e.corpus, e.split) for e in entries} == {(corpus, subset)}
    assert all(e.audio.startswith(f"hf:{hf_root}/") for e in entries)
    assert entries == subset_manifest(hf_root, corpus, subset, locale, "en", Skips())
    assert adapter.find_hf(tmp_path, subset, locale) is None
    assert str(tmp_path) in adapter.looked_for_hf(tmp_path, subset, locale)[0]


def test_ambiguous_or_missing_hf_splits_are_clear_errors(
    hf_root: Path, tiny_corpus_root: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"test-other.*other/test-\*\.parquet"):
        subset_manifest(hf_root, "librispeech", "test-other", None, "en", Skips())
    # validation/ of an unknown config could be clean or other: not taken for dev-clean.
    rows = librispeech_rows(tiny_corpus_root / "LibriSpeech" / "dev-clean")
    save_to_disk(rows, tmp_path / "librispeech_asr" / "validation")
    with pytest.raises(UserError, match="not found"):
        subset_manifest(tmp_path, "librispeech", "dev-clean", None, "en", Skips())
    # The same split in two datasets.
    extra = tmp_path / "two"
    (extra / "common_voice_a" / "en").mkdir(parents=True)
    (extra / "common_voice_b" / "en").mkdir(parents=True)
    for name in ("common_voice_a", "common_voice_b"):
        src = next((hf_root / "common_voice_13_0" / "en").glob("train-*.parquet"))
        (extra / name / "en" / src.name).write_bytes(src.read_bytes())
    with pytest.raises(UserError, match="several Hugging Face datasets"):
        subset_manifest(extra, "commonvoice", "train", "en", "en", Skips())


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
    write_parquet(
        table.to_pydict(), tmp_path / "data" / "common_voice" / "en" / "validation-0.parquet"
    )
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
    write_parquet({"path": ["a.mp3"], "audio": [None]},
                  tmp_path / "cols" / "common_voice" / "en" / "train-0.parquet")  # fmt: skip
    with pytest.raises(UserError, match=r"train-0\.parquet.*client_id, sentence"):
        subset_manifest(tmp_path / "cols", "commonvoice", "train", "en", "en", Skips())
