"""When a cached feature store is reused and when it is not: a clip changed in place (same size)
gets a new store; rows the manifest drops are reported from the latest reading; an eval set whose
every clip is undecodable is a clear error with the skip counts, not a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_data_corpora import CV, read_tsv

from pflbench.data.prepare import prepare_task
from pflbench.errors import UserError
from pflbench.spec.models import Task


@pytest.fixture
def corpus_copy(tiny_task: Task, tiny_corpus_root: Path, tmp_path: Path):
    """(task reading a downloaded copy of the tiny corpora, the copy, a fresh cache)."""
    copy = tmp_path / "corpora"
    shutil.copytree(tiny_corpus_root, copy)
    return tiny_task.model_copy(update={"synthetic": None}), copy, tmp_path / "cache"


def _dev_clips(root: Path) -> list[Path]:
    return [root / CV / "clips" / row["path"] for row in read_tsv(root / CV / "dev.tsv")]


def test_a_clip_changed_in_place_with_its_size_kept_gets_a_new_store(corpus_copy):
    task, root, cache = corpus_copy
    before = prepare_task(task, data_root=root, cache_dir=cache, progress=False).eval_sets
    clip = _dev_clips(root)[0]
    data = bytearray(clip.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):  # other audio, the same byte count
        data[i] ^= 0x5A
    clip.write_bytes(bytes(data))
    after = prepare_task(task, data_root=root, cache_dir=cache, progress=False).eval_sets
    assert after["cv-dev"].path != before["cv-dev"].path
    assert after["cv-dev"].audio_digest != before["cv-dev"].audio_digest
    assert after["cv-test"].path == before["cv-test"].path


def test_rows_the_manifest_drops_later_are_reported_from_the_reused_store(corpus_copy):
    task, root, cache = corpus_copy
    before = prepare_task(task, data_root=root, cache_dir=cache, progress=False).eval_sets
    with (root / CV / "dev.tsv").open("a", encoding="utf-8") as f:
        f.write("a row\twith too few fields\n")
    after = prepare_task(task, data_root=root, cache_dir=cache, progress=False).eval_sets
    # The same rows kept: the same store, its report now counting the dropped row.
    assert after["cv-dev"].path == before["cv-dev"].path
    assert after["cv-dev"].digest == before["cv-dev"].digest
    counts = after["cv-dev"].stats()["skipped"]["counts"]
    assert counts.get("malformed_tsv_row") == 1, counts
    assert before["cv-dev"].stats()["skipped"].get("counts", {}) == {}


def test_an_eval_set_without_one_decodable_clip_is_a_clear_error(corpus_copy):
    task, root, cache = corpus_copy
    clips = _dev_clips(root)
    for clip in clips:
        clip.write_bytes(b"not audio at all" * 64)
    with pytest.raises(UserError) as caught:
        prepare_task(task, data_root=root, cache_dir=cache, progress=False)
    message = str(caught.value)
    assert f"cv-dev: none of its {len(clips)} utterances under {root} could be used" in message
    assert f"skipped {len(clips)} (unreadable_audio {len(clips)}, e.g. " in message
