"""WER/CER scoring: pooled vs speaker-averaged, and empty references/hypotheses."""

import pytest

from pflbench.evaluate import Transcript, edit_counts, score


def t(speaker: str, ref: str, hyp: str) -> Transcript:
    return Transcript(f"{speaker}-{ref}", speaker, ref, hyp)


def test_pooled_and_speaker_averaged_wer_differ_by_weighting():
    result = score(
        [
            t("a", "one two three four", "one two three four"),  # 0 / 4
            t("a", "five six seven eight", "five six seven eight"),  # 0 / 4
            t("b", "nine ten", "nine"),  # 1 / 2
        ]
    )
    assert result["wer"] == pytest.approx(1 / 10)
    assert result["per_speaker"] == {"a": 0.0, "b": 0.5}
    assert result["speaker_wer_mean"] == pytest.approx(0.25)
    assert result["speaker_wer_std"] == pytest.approx(0.25)
    assert (result["num_speakers"], result["num_utterances"], result["num_words"]) == (2, 3, 10)


def test_speaker_wer_deciles_show_how_unevenly_errors_fall():
    # ten speakers of ten words with 0..9 errors: speaker WERs 0.0, 0.1, ..., 0.9
    words = " ".join(f"w{i}" for i in range(10))
    transcripts = [
        t(f"s{k}", words, " ".join(f"w{i}" if i >= k else "x" for i in range(10)))
        for k in range(10)
    ]
    result = score(transcripts)
    assert result["speaker_wer_p10"] == pytest.approx(0.1)
    assert result["speaker_wer_p50"] == pytest.approx(0.45)
    assert result["speaker_wer_p90"] == pytest.approx(0.8)
    assert result["speaker_counts"]["s3"] == (3, 10)


def test_cer_counts_characters():
    result = score([t("a", "abc", "abd")])
    assert result["cer"] == pytest.approx(1 / 3) and result["wer"] == 1.0


def test_empty_hypothesis_deletes_every_reference_word():
    assert edit_counts(["a b c"], [""], "word") == [(3, 3)]
    assert score([t("a", "a b c", "")])["wer"] == 1.0


def test_empty_reference_counts_insertions_and_never_divides_by_zero():
    assert edit_counts(["", ""], ["x y", ""], "word") == [(2, 0), (0, 0)]
    result = score([t("a", "", "x y"), t("b", "hello there", "hello there")])
    assert result["wer"] == pytest.approx(2 / 2)  # 2 insertions over 2 reference words
    assert result["per_speaker"] == {"a": None, "b": 0.0}
    assert result["speakers_without_words"] == 1 and result["speaker_wer_mean"] == 0.0
    only_empty = score([t("a", "", "")])
    assert only_empty["wer"] is None and only_empty["speaker_wer_mean"] is None


def test_substitution_deletion_insertion_counts():
    # ref "a b c d" vs hyp "a x c d e": 1 substitution + 1 insertion
    assert edit_counts(["a b c d"], ["a x c d e"], "word") == [(2, 4)]
    assert edit_counts(["a b c d"], ["a c"], "word") == [(2, 4)]
