"""Synthetic corpora, adapters, user splits, the feature store and bad input, end to end."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.cli.specs import source_name
from pflbench.data import store as store_module
from pflbench.data.adapters import CORPORA
from pflbench.data.corpora import Skips, commonvoice_manifest
from pflbench.data.prepare import (
    data_root_for,
    prepare_task,
    source_manifest,
    subset_manifest,
)
from pflbench.data.splits import apply_user_split, iid_reassign, users_digest
from pflbench.data.store import FeatureStore, build_store
from pflbench.data.synth import CV_COLUMNS, CV_RELEASE, SIZES, CvUsersUnit, plan_units, synthesize
from pflbench.errors import UserError
from pflbench.files import exclusive
from pflbench.methods import check_task
from pflbench.spec.models import DataSource, EvalSet, Task

CV = Path(CV_RELEASE) / "en"


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()


def read_tsv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def test_tiny_corpora_have_the_real_formats(tiny_corpus_root: Path) -> None:
    ls = tiny_corpus_root / "LibriSpeech"
    assert {p.name for p in ls.iterdir()} >= {"train-clean-100", "dev-clean", "test-clean"}
    assert (ls / "SPEAKERS.TXT").read_text().startswith(";ID")
    trans = sorted(ls.glob("train-clean-100/*/*/*.trans.txt"))[0]
    utt, text = trans.read_text().splitlines()[0].split(" ", 1)
    assert text == text.upper() and text.strip()
    info = sf.info(trans.parent / f"{utt}.flac")
    assert info.samplerate == 16000 and info.format == "FLAC"
    rows = read_tsv(tiny_corpus_root / CV / "train.tsv")
    assert list(rows[0]) == CV_COLUMNS
    assert any(r["sentence"] != r["sentence"].lower() for r in rows)  # mixed case
    clip = sf.info(tiny_corpus_root / CV / "clips" / rows[0]["path"])
    assert clip.samplerate == 48000 and clip.format == "MP3"
    users = {s: {r["client_id"] for r in read_tsv(tiny_corpus_root / CV / f"{s}.tsv")}
             for s in ("train", "dev", "test")}  # fmt: skip
    assert not (users["train"] & users["dev"]) and not (users["train"] & users["test"])
    clips = sorted(Counter(r["client_id"] for r in rows).values())
    assert clips[0] == 1 and clips[-1] >= 3 * np.median(clips)  # heavy tail
    validated = read_tsv(tiny_corpus_root / CV / "validated.tsv")
    assert len(validated) == sum(len(read_tsv(tiny_corpus_root / CV / f"{s}.tsv"))
                                 for s in ("train", "dev", "test"))  # fmt: skip


def test_small_size_plans_heavy_tailed_users() -> None:
    units = plan_units(Path("/nonexistent"), "en", SIZES["small"], seed=0)
    clips = [n for u in units if isinstance(u, CvUsersUnit) and u.split == "train"
             for _, n, _ in u.users]  # fmt: skip
    assert len(clips) > 1000 and np.median(clips) <= 2 and max(clips) >= 100


def high_band_fraction(path: Path) -> float:
    """Fraction of the 0-8 kHz energy above 4.5 kHz."""
    wave, rate = sf.read(path, dtype="float32")
    power = np.abs(np.fft.rfft(wave)) ** 2
    freq = np.fft.rfftfreq(len(wave), 1 / rate)
    return float(power[(freq > 4500) & (freq < 8000)].sum() / power[freq < 8000].sum())


def test_cv_like_clips_come_through_band_limited_microphones(tiny_corpus_root: Path) -> None:
    cv = sorted((tiny_corpus_root / CV / "clips").glob("*.mp3"))[:20]
    ls = sorted((tiny_corpus_root / "LibriSpeech").rglob("*.flac"))[:20]
    cv_high = np.median([high_band_fraction(p) for p in cv])
    ls_high = np.median([high_band_fraction(p) for p in ls])
    assert cv_high < 0.5 * ls_high, (cv_high, ls_high)


@pytest.mark.slow
def test_synthesis_is_byte_for_byte_deterministic(tiny_corpus_root: Path, tmp_path: Path) -> None:
    again = synthesize(tmp_path / "again", "en", "tiny", seed=0)
    assert tree_digest(again) == tree_digest(tiny_corpus_root)


def test_task_data_stores(tiny_task_data, tiny_corpus_root: Path) -> None:
    fed = tiny_task_data.federated_train
    train_rows = read_tsv(tiny_corpus_root / CV / "train.tsv")
    assert fed.users() == sorted({r["client_id"] for r in train_rows})
    assert len(fed) == len(train_rows)
    user = max(fed.users(), key=fed.user_num_utterances)
    utts = fed.load_user(user)
    assert len(utts) == fed.user_num_utterances(user) and {u.user_id for u in utts} == {user}
    assert abs(sum(u.seconds for u in utts) - fed.user_seconds(user)) < 1e-3
    u = utts[0]
    assert u.feats.dtype.is_floating_point and u.feats.shape[1] == 80
    assert abs(len(u.feats) - u.seconds * 100) <= 2
    assert tiny_task_data.tokenizer.decode(u.tokens.tolist()) == u.text
    assert [x.user_id for x in fed] == sorted(x.user_id for x in fed)
    assert fed.utterance_seconds() == [x.seconds for x in fed]  # read without the features
    seed = tiny_task_data.seed_train
    assert all(len(s) == 3 for s in seed.users())  # LibriSpeech user = speaker id
    assert set(tiny_task_data.eval_sets) == {"cv-dev", "cv-test", "ls-dev-clean"}
    stats = fed.stats()
    assert stats["users"] == len(fed.users()) and stats["minutes_per_user"]["max"] > 0


def test_prepare_reuses_the_store(
    tiny_task, tiny_cache_dir: Path, tiny_task_data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of what prepare_task built in the session's cache: the tests running beside this
    # one (other xdist workers) add seed models to that cache.
    cache = tmp_path / "cache"
    with exclusive(tiny_cache_dir / "prepare.lock"):
        for name in ("synth", "features"):
            shutil.copytree(tiny_cache_dir / name, cache / name)
        shutil.copy2(tiny_cache_dir / "prepare.lock", cache / "prepare.lock")

    def files() -> dict[Path, tuple[int, int, int]]:
        return {
            p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in cache.rglob("*")
            if p.is_file()
        }

    shards_written = []
    write_shard = store_module.write_shard
    monkeypatch.setattr(
        store_module, "write_shard", lambda *a: shards_written.append(a[0]) or write_shard(*a)
    )
    before = files()
    again = prepare_task(tiny_task, cache_dir=cache, progress=False)
    # nothing built, rewritten or added: every cached file is the same inode, untouched
    assert shards_written == [] and files() == before
    assert any(p.name.startswith("shard-") for p in before)
    built = tiny_task_data.federated_train.path
    assert again.federated_train.path == cache / built.relative_to(tiny_cache_dir)
    assert again.federated_train.digest == tiny_task_data.federated_train.digest


def test_a_corpus_gets_the_same_stores_and_digests_wherever_it_lies(
    tiny_task: Task, tiny_corpus_root: Path, tiny_task_data, tmp_path: Path
) -> None:
    """A copy of the corpus in another folder, read as a downloaded corpus with another cache:
    the same store keys (folder names) and the same content digests as the original. Then one
    dev clip of the copy changed: another store and other digests of that split only."""
    copy = tmp_path / "elsewhere" / "corpora"
    shutil.copytree(tiny_corpus_root, copy)
    task = tiny_task.model_copy(update={"synthetic": None})
    cache = tmp_path / "cache"
    data = prepare_task(task, data_root=copy, cache_dir=cache, progress=False)

    def stores(d) -> dict:
        return {"seed": d.seed_train, "federated": d.federated_train, **d.eval_sets}

    original = stores(tiny_task_data)
    for name, store in stores(data).items():
        assert store.path.name == original[name].path.name, name
        assert store.digest == original[name].digest, name
        assert store.audio_digest == original[name].audio_digest, name

    dev_clips = [copy / CV / "clips" / row["path"] for row in read_tsv(copy / CV / "dev.tsv")]
    other = next(c for c in dev_clips if c.stat().st_size != dev_clips[0].stat().st_size)
    shutil.copy(other, dev_clips[0])  # a dev clip now holds another clip's audio
    changed = stores(prepare_task(task, data_root=copy, cache_dir=cache, progress=False))
    for name, store in stores(data).items():
        same = name != "cv-dev"
        assert (store.path == changed[name].path) == same, name
        assert (store.digest == changed[name].digest) == same, name
        assert (store.audio_digest == changed[name].audio_digest) == same, name


def test_user_split_is_complementary_and_order_independent(tiny_corpus_root: Path) -> None:
    entries = commonvoice_manifest(
        tiny_corpus_root / CV / "train.tsv", "train", "en", Skips()
    ).entries
    part_in = apply_user_split(entries, 10, "in", seed=0)
    part_out = apply_user_split(entries, 10, "out", seed=0)
    users_in, users_out = {e.user_id for e in part_in}, {e.user_id for e in part_out}
    all_users = {e.user_id for e in entries}
    assert users_in | users_out == all_users and not users_in & users_out
    assert len(users_in) == round(0.1 * len(all_users))
    shuffled = apply_user_split(entries[::-1], 10, "in", seed=0)
    assert users_digest(e.user_id for e in shuffled) == users_digest(users_in)
    assert {e.user_id for e in apply_user_split(entries, 10, "in", seed=1)} != users_in
    iid = iid_reassign(entries, seed=0)
    assert sorted(e.utt_id for e in iid) == sorted(e.utt_id for e in entries)
    assert {e.user_id for e in iid} <= all_users
    assert iid_reassign(entries[::-1], seed=0) == iid


def test_store_resumes_after_an_interrupted_build(
    tiny_corpus_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "SHARD_UTTERANCES", 10)
    entries = commonvoice_manifest(tiny_corpus_root / CV / "dev.tsv", "dev", "en", Skips()).entries
    folder = tmp_path / "store"
    full = build_store(folder, entries, "en", {}, workers=1)
    shards = sorted(folder.glob("shard-*.arrow"))
    assert len(shards) >= 2
    # Interrupt: index gone, last shard gone, a half-written temp file left behind.
    (folder / "index.json").unlink()
    shards[-1].unlink()
    (folder / f"{shards[-1].name}.tmp-123").write_bytes(b"partial")
    kept = shards[0].stat().st_mtime_ns
    resumed = build_store(folder, entries, "en", {}, workers=1)
    assert shards[0].stat().st_mtime_ns == kept  # finished shards are not redone
    assert resumed.users() == full.users()
    a, b = list(full), list(resumed)
    assert [u.utt_id for u in a] == [u.utt_id for u in b]
    assert all(np.array_equal(x.feats, y.feats) for x, y in zip(a, b, strict=True))


def test_building_a_store_in_process_keeps_the_callers_thread_count(
    tiny_corpus_root: Path, tmp_path: Path
) -> None:
    # One shard left to build runs in this process: seed training after a fresh prepare used to
    # run on the one thread the shard builder set.
    entries = commonvoice_manifest(tiny_corpus_root / CV / "dev.tsv", "dev", "en", Skips()).entries
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        build_store(tmp_path / "store", entries, "en", {}, workers=1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# Bad input: each case is skipped, counted by reason, with example ids in the report.


def real_task(name: str = "bad-input") -> Task:
    return Task(
        name=name, version=1, language="en", description="real-format corpora with faults",
        federated_data=DataSource(corpus="commonvoice", subsets=["dev"], locale="en"),
        eval_sets=[EvalSet(name="ls-dev", corpus="librispeech", subset="dev-clean", role="dev")],
    )  # fmt: skip


@pytest.fixture(scope="module")
def faulty_root(tiny_corpus_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faulty")
    shutil.copytree(
        tiny_corpus_root / "LibriSpeech" / "dev-clean", root / "LibriSpeech" / "dev-clean"
    )
    cv = root / "cv-corpus-99.0" / "en"
    (cv / "clips").mkdir(parents=True)
    rows = read_tsv(tiny_corpus_root / CV / "dev.tsv")
    for r in rows:
        shutil.copy(tiny_corpus_root / CV / "clips" / r["path"], cv / "clips" / r["path"])
    # LibriSpeech faults.
    flacs = sorted((root / "LibriSpeech" / "dev-clean").glob("*/*/*.flac"))
    data = flacs[0].read_bytes()
    flacs[0].write_bytes(data[: len(data) // 2])  # truncated
    flacs[1].write_bytes(b"fLaC" + bytes(200))  # corrupt
    trans = next(flacs[2].parent.glob("*.trans.txt"))
    stem = flacs[2].stem.rsplit("-", 1)[0]
    sf.write(flacs[2].parent / f"{stem}-0900.flac", np.zeros(0), 16000, format="FLAC")
    shutil.copy(flacs[2], flacs[2].parent / f"{stem}-0901.flac")
    shutil.copy(flacs[2], flacs[2].parent / f"{stem}-0902.flac")
    with trans.open("a") as f:
        f.write(f"{stem}-0900 ZERO LENGTH\n")  # zero-length audio
        f.write(f"{stem}-0901\n")  # empty transcript
        f.write(f"{stem}-0902 1234 5678\n")  # only characters outside the token set
        f.write(f"{stem}-0903 NO SUCH AUDIO\n")  # trans.txt line whose audio is missing
    # Common Voice faults (quoting off: an unbalanced quote is just a character).
    header = "\t".join(CV_COLUMNS)
    lines = ["\t".join(r[c] for c in CV_COLUMNS) for r in rows]
    first = rows[0]
    lines.append("\t".join([first["client_id"], "missing_clip.mp3", "Hello."] + [""] * 8))
    lines.append("\t".join([first["client_id"], "short_row.mp3", "Too few fields"]))
    shutil.copy(cv / "clips" / first["path"], cv / "clips" / "empty_sentence.mp3")
    lines.append("\t".join([first["client_id"], "empty_sentence.mp3", ""] + [""] * 8))
    shutil.copy(cv / "clips" / first["path"], cv / "clips" / "quote.mp3")
    lines.append("\t".join([first["client_id"], "quote.mp3", 'He said "hello there.'] + [""] * 8))
    # A sentence in another script: transliterated it would be words nobody said ("moskva").
    shutil.copy(cv / "clips" / first["path"], cv / "clips" / "cyrillic.mp3")
    lines.append("\t".join([first["client_id"], "cyrillic.mp3", "Welcome to Москва."] + [""] * 8))
    (cv / "dev.tsv").write_text(header + "\n" + "\n".join(lines) + "\n")
    return root


def test_bad_input_is_skipped_counted_and_reported(faulty_root: Path, tmp_path: Path) -> None:
    data = prepare_task(real_task(), data_root=faulty_root, cache_dir=tmp_path, progress=False)
    ls = data.report["eval:ls-dev"]["skipped"]
    cv = data.report["federated"]["skipped"]
    flacs = sorted((faulty_root / "LibriSpeech" / "dev-clean").glob("*/*/*.flac"))
    unreadable = ls["examples"].get("unreadable_audio", []) + ls["examples"].get(
        "truncated_audio", []
    )
    assert flacs[0].stem in unreadable and flacs[1].stem in unreadable
    stem = flacs[2].stem.rsplit("-", 1)[0]
    assert ls["examples"]["zero_length_audio"] == [f"{stem}-0900"]
    assert ls["examples"]["empty_transcript"] == [f"{stem}-0901"]
    assert ls["examples"]["characters_outside_token_set"] == [f"{stem}-0902"]
    assert ls["examples"]["missing_audio_file"] == [f"{stem}-0903"]
    assert cv["counts"] == {
        "characters_outside_token_set": 1, "empty_transcript": 1, "malformed_tsv_row": 1,
        "missing_audio_file": 1,
    }  # fmt: skip
    assert cv["examples"]["missing_audio_file"] == ["missing_clip"]
    assert cv["examples"]["characters_outside_token_set"] == ["cyrillic"]
    fed = data.federated_train
    assert "he said hello there" in {u.text for u in fed}
    n_rows = len(read_tsv(faulty_root / "cv-corpus-99.0" / "en" / "dev.tsv"))
    assert len(fed) == n_rows - 4  # missing clip, empty sentence, short row, Cyrillic
    # Where each split was read, and why LibriSpeech's speakers have no groups here.
    assert data.report["federated"]["read_from"] == {"dev": "cv-corpus-99.0/en/dev.tsv"}
    assert data.report["eval:ls-dev"]["read_from"] == {"dev-clean": "LibriSpeech/dev-clean"}
    assert data.report["eval:ls-dev"]["speaker_groups"] == {}
    assert data.report["eval:ls-dev"]["speaker_groups_unavailable"] == (
        "no speaker genders: LibriSpeech/SPEAKERS.TXT is missing or lists none"
    )
    assert set(data.report["federated"]["speaker_groups"]) == set(data.eval_groups["ls-dev"]) | {
        "accent", "age", "gender"
    }  # fmt: skip


def test_data_stats_cli_reports_skips(faulty_root: Path, tmp_path: Path, monkeypatch) -> None:
    specs = tmp_path / "specs" / "tasks"
    specs.mkdir(parents=True)
    spec = real_task("bad-input-cli").model_dump(mode="json", exclude_none=True, exclude={"recipe"})
    (specs / "bad-input-cli.yaml").write_text(json.dumps(spec))
    monkeypatch.setenv("PFLBENCH_CACHE", str(tmp_path / "cache"))
    args = ["data", "stats", "--task", "bad-input-cli", "--specs", str(tmp_path / "specs"),
            "--data-root", str(faulty_root), "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["federated"]["skipped"]["counts"]["malformed_tsv_row"] == 1
    assert report["eval:ls-dev"]["users"] >= 1


def test_data_synth_refuses_an_out_that_is_a_file_or_not_empty(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    for out, why in ((a_file, "is a file, not a folder"), (tmp_path, "is not empty")):
        result = CliRunner().invoke(app, ["data", "synth", "--size", "tiny", "--out", str(out)])
        assert isinstance(result.exception, UserError), result.output
        assert why in str(result.exception)


def test_missing_data_errors_name_what_was_expected(
    faulty_root: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("PFLBENCH_DATA", raising=False)
    with pytest.raises(UserError, match="synth-"):
        data_root_for(real_task(), None)
    task = real_task().model_copy(
        update={
            "eval_sets": [EvalSet(name="x", corpus="librispeech", subset="test-other", role="dev")]
        }
    )
    with pytest.raises(UserError, match="LibriSpeech/test-other") as raised:
        prepare_task(task, data_root=faulty_root, cache_dir=tmp_path, progress=False)
    assert str(raised.value).endswith(f"found instead: {faulty_root}/LibriSpeech holds dev-clean")
    with pytest.raises(UserError) as raised:
        subset_manifest(faulty_root, "commonvoice", "dev", "fr", "fr", Skips())
    assert str(raised.value).endswith(f"found instead: {faulty_root}/cv-corpus-99.0 holds en")
    shutil.copytree(faulty_root / "cv-corpus-99.0", faulty_root / "cv-corpus-98.0")
    try:
        with pytest.raises(UserError, match="several Common Voice releases"):
            prepare_task(real_task(), data_root=faulty_root, cache_dir=tmp_path, progress=False)
    finally:
        shutil.rmtree(faulty_root / "cv-corpus-98.0")


# ----------------------------------------------------------------------------------------------
# Bad text files, duplicates and missing speakers, on small corpora written here (the manifest
# readers look at the audio files' existence only).

TONE = 0.1 * np.sin(np.linspace(0, 200 * np.pi, 8000))  # half a second at 16 kHz


def small_librispeech(root: Path, lines: list[str]) -> Path:
    """LibriSpeech/dev-clean/1070/8901 with `lines` as its trans.txt (returned) and a FLAC file
    for each utterance id."""
    chapter = root / "LibriSpeech" / "dev-clean" / "1070" / "8901"
    chapter.mkdir(parents=True)
    for line in lines:
        sf.write(chapter / f"{line.split()[0]}.flac", TONE, 16000)
    trans = chapter / "1070-8901.trans.txt"
    trans.write_text("\n".join(lines) + "\n")
    return trans


def cv_line(row: tuple[str, str, str]) -> str:
    """A release TSV's line of (client_id, path, sentence), the other columns empty."""
    return "\t".join([*row, *[""] * (len(CV_COLUMNS) - 3)])


def small_commonvoice(root: Path, split: str, rows: list[tuple[str, str, str]]) -> Path:
    """cv-corpus-99.0/en/<split>.tsv (returned) with the release's header and (client_id, path,
    sentence) rows, and an MP3 clip for each path."""
    locale = root / "cv-corpus-99.0" / "en"
    (locale / "clips").mkdir(parents=True, exist_ok=True)
    for _, path, _ in rows:
        sf.write(locale / "clips" / path, TONE, 16000, format="MP3")
    lines = ["\t".join(CV_COLUMNS), *map(cv_line, rows)]
    tsv = locale / f"{split}.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    return tsv


def test_a_trans_txt_that_is_not_utf8_is_an_error_naming_its_line(tmp_path: Path) -> None:
    trans = small_librispeech(tmp_path, ["1070-8901-0000 HELLO THERE", "1070-8901-0001 CAFE NOIR"])
    trans.write_bytes(trans.read_bytes().replace(b"CAFE", b"CAF\xe9"))  # a Latin-1 e-acute
    with pytest.raises(UserError, match=r"8901\.trans\.txt: line 2 is not UTF-8 \(byte 0xe9 at"):
        subset_manifest(tmp_path, "librispeech", "dev-clean", None, "en", Skips())


def test_a_tsv_that_is_not_utf8_is_an_error_naming_its_line(tmp_path: Path) -> None:
    # Far enough down that the TSV's streaming decoder meets it in a later chunk.
    rows = [(f"speaker{i}", f"clip{i}.mp3", f"Sentence number {i}.") for i in range(3000)]
    tsv = small_commonvoice(tmp_path, "dev", rows[:1])
    lines = tsv.read_text().splitlines() + [cv_line(r) for r in rows[1:]]  # clips not needed
    lines[2001] = lines[2001].replace("Sentence", "Na\xefve")
    tsv.write_bytes("\n".join(lines).encode("latin-1"))
    with pytest.raises(UserError, match=r"en/dev\.tsv: line 2002 is not UTF-8 \(byte 0xef at"):
        subset_manifest(tmp_path, "commonvoice", "dev", "en", "en", Skips())


def test_an_utterance_listed_twice_is_read_once_as_first_listed(tmp_path: Path) -> None:
    small_librispeech(tmp_path, ["1070-8901-0000 HELLO THERE", "1070-8901-0001 GOOD DAY",
                                 "1070-8901-0000 A DIFFERENT TRANSCRIPT"])  # fmt: skip
    skips = Skips()
    entries = subset_manifest(tmp_path, "librispeech", "dev-clean", None, "en", skips).entries
    assert [(e.utt_id, e.text) for e in entries] == [
        ("1070-8901-0000", "hello there"), ("1070-8901-0001", "good day")
    ]  # fmt: skip
    assert skips.to_dict() == {
        "counts": {"duplicate_utterance": 1},
        "examples": {"duplicate_utterance": ["1070-8901-0000"]},
    }


def test_a_clip_in_two_subsets_of_a_source_is_read_once(tmp_path: Path) -> None:
    dev = [("a", "one.mp3", "Hello there."), ("b", "two.mp3", "Good day.")]
    small_commonvoice(tmp_path, "dev", dev)
    # validated.tsv repeats dev's clips, and here one of its own.
    three = ("c", "three.mp3", "Good night.")
    small_commonvoice(tmp_path, "validated", [*dev, three, three])
    source = DataSource(corpus="commonvoice", subsets=["dev", "validated"], locale="en")
    skips = Skips()
    entries, _, _ = source_manifest(tmp_path, source, "en", skips)
    assert [(e.utt_id, e.split) for e in entries] == [
        ("one", "dev"), ("two", "dev"), ("three", "validated")
    ]  # fmt: skip
    # Across subsets as within one TSV: counted alike, the first listing kept.
    assert skips.to_dict() == {
        "counts": {"duplicate_utterance": 3},
        "examples": {"duplicate_utterance": ["one", "two", "three"]},
    }


def test_cv_rows_without_a_client_id_are_skipped_not_merged_into_one_user(tmp_path: Path) -> None:
    rows = [("a", "one.mp3", "Hello there."), ("", "two.mp3", "Good day."),
            (" ", "three.mp3", "Good night.")]  # fmt: skip
    small_commonvoice(tmp_path, "dev", rows)
    skips = Skips()
    entries = subset_manifest(tmp_path, "commonvoice", "dev", "en", "en", skips).entries
    assert [(e.utt_id, e.user_id) for e in entries] == [("one", "a")]
    assert skips.to_dict() == {
        "counts": {"missing_user_id": 2},
        "examples": {"missing_user_id": ["two", "three"]},
    }


def test_feature_store_rejects_an_unfinished_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="index.json"):
        FeatureStore(tmp_path)


# ----------------------------------------------------------------------------------------------
# The corpus registry: each adapter finds its subsets in the tiny corpora, and says where it
# looked when they are missing (a new corpus needs its case here and in test_data_hf.py).

ADAPTER_CASES = {
    # corpus: (subset, locale, where it lies, the not-found error under an empty root)
    "librispeech": (
        "dev-clean",
        "en",
        "LibriSpeech/dev-clean",
        "LibriSpeech subset 'dev-clean' not found; looked for {root}/LibriSpeech/dev-clean;"
        " {root}/dev-clean; {root}[/*librispeech*]/all/validation.clean/ (save_to_disk or"
        " *.parquet) or all/validation.clean-*.parquet or validation.clean/ (save_to_disk or"
        " *.parquet) or validation.clean-*.parquet; {root}[/*librispeech*]/clean/validation/"
        " (save_to_disk or *.parquet) or clean/validation-*.parquet or validation/ (save_to_disk"
        " of config clean)",
    ),
    "commonvoice": (
        "dev",
        "en",
        f"{CV_RELEASE}/en/dev.tsv",
        "Common Voice en split 'dev' not found; looked for {root}/cv-corpus-*/en/dev.tsv;"
        " {root}/en/dev.tsv; {root}[/*common_voice*]/en/validation/ (save_to_disk or *.parquet)"
        " or en/validation-*.parquet or validation/ (save_to_disk of config en or of none)",
    ),
}


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_each_corpus_adapter_finds_and_reads_its_subsets(
    corpus: str, tiny_corpus_root: Path, tmp_path: Path
) -> None:
    adapter = CORPORA[corpus]
    subset, locale, where, _ = ADAPTER_CASES[corpus]
    found = adapter.find(tiny_corpus_root, subset, locale)
    assert found == tiny_corpus_root / where
    entries = adapter.read(found, subset, "en", Skips()).entries
    assert entries and {(e.corpus, e.split) for e in entries} == {(corpus, subset)}
    assert len({e.user_id for e in entries}) > 1
    assert adapter.find(tiny_corpus_root, "no-such-subset", locale) is None
    assert adapter.find(tmp_path, subset, locale) is None
    assert adapter.find_hf(tmp_path, subset, locale) is None


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_each_corpus_adapter_names_where_it_looked(corpus: str, tmp_path: Path) -> None:
    subset, locale, _, message = ADAPTER_CASES[corpus]
    with pytest.raises(UserError) as raised:
        subset_manifest(tmp_path, corpus, subset, locale, "en", Skips())
    assert str(raised.value) == message.format(root=tmp_path)


def test_specs_name_registered_corpora_and_commonvoice_sources_need_a_locale() -> None:
    assert list(CORPORA) == ["librispeech", "commonvoice"]
    task = Task(
        name="t", version=1, language="en", description="",
        federated_data=DataSource(corpus="voxpopuli", subsets=["train"]),
        eval_sets=[EvalSet(name="d", corpus="librispeech", subset="dev-clean", role="dev")],
    )  # fmt: skip
    with pytest.raises(UserError, match="t.yaml: unknown corpus 'voxpopuli'; known: librispeech, "
                       "commonvoice"):  # fmt: skip
        check_task(task, "t.yaml")
    with pytest.raises(UserError, match="unknown corpus 'voxpopuli'; known: librispeech"):
        CORPORA["voxpopuli"]
    # Common Voice releases hold many languages: a training source names its locale.
    assert [CORPORA[c].needs_locale for c in CORPORA] == [False, True]
    no_locale = task.model_copy(
        update={"federated_data": DataSource(corpus="commonvoice", subsets=["train"])}
    )
    with pytest.raises(UserError, match="t.yaml: a commonvoice source needs a locale"):
        check_task(no_locale, "t.yaml")
    assert DataSource(corpus="librispeech", subsets=["train-clean-100"]).locale is None


def test_sources_are_named_as_the_paper_names_them() -> None:
    ls = DataSource(corpus="librispeech", subsets=["train-other-500", "train-clean-360"])
    assert source_name(ls) == "LS-860"
    assert source_name(ls.model_copy(update={"subsets": ["dev-clean"]})) == "LS:dev-clean"
    cv = DataSource(corpus="commonvoice", subsets=["train"], locale="fr", iid=True)
    assert source_name(cv) == "CV-fr-train (IID)"


def test_an_utterance_filed_under_another_speaker_is_skipped_and_counted(tmp_path: Path) -> None:
    """Its id names one speaker (the DP user), its folder another: it is not taken as either."""
    small_librispeech(tmp_path, ["1070-8901-0000 HELLO THERE", "2412-8901-0001 GOOD DAY"])
    skips = Skips()
    entries = subset_manifest(tmp_path, "librispeech", "dev-clean", None, "en", skips).entries
    assert [e.utt_id for e in entries] == ["1070-8901-0000"]
    assert skips.counts == {"misplaced_utterance": 1}


def test_a_tsv_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    rows = [("speaker0", "clip0.mp3", "Hello there."), ("speaker1", "clip1.mp3", "Good day.")]
    tsv = small_commonvoice(tmp_path, "dev", rows)
    plain = subset_manifest(tmp_path, "commonvoice", "dev", "en", "en", Skips()).entries
    tsv.write_bytes(b"\xef\xbb\xbf" + tsv.read_bytes())
    assert subset_manifest(tmp_path, "commonvoice", "dev", "en", "en", Skips()).entries == plain
