"""Evaluation: greedy CTC transcripts → WER/CER with jiwer on normalized text.

Reported per eval set:
- pooled WER/CER: total errors / total reference words (chars) over the set, the standard way;
- speaker-averaged WER: each speaker's own pooled WER, averaged with equal weight per speaker (the
  paper weights speakers equally), with its std, median and 10th/90th percentiles (the value at
  the rank nearest q·(n-1), numpy's method="nearest", ties to the even rank):
  how unevenly the errors fall on speakers;
- per speaker: (word errors, reference words), the counts a speaker-level bootstrap resamples
  (pflbench.results.stats);
- per utterance: id, speaker, hypothesis, word errors / reference words, char errors / chars (the
  runner writes the counts to the run directory, errors/<eval set>.jsonl, and the hypotheses to
  hypotheses/<eval set>.jsonl.gz, from which `pflbench submit` re-scores the run).

Empty texts are handled: an empty hypothesis counts every reference word as a deletion; an empty
reference counts every hypothesis word as an insertion. A speaker whose references are all empty
has no WER and is left out of the speaker average (counted in `speakers_without_words`); a set
with no reference words at all has WER None.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jiwer
import torch

from pflbench import __version__
from pflbench.data.batching import chunks, collate, dynamic_batches
from pflbench.files import atomic_write_text
from pflbench.model.transformer import CTCTransformer, greedy_decode
from pflbench.numerics import NUMERICS_VERSION
from pflbench.spec.resolve import canonical_json


@dataclass(frozen=True)
class Transcript:
    utt_id: str
    speaker: str
    reference: str
    hypothesis: str


# ----------------------------------------------------------------------------------------------
# Error counting


def edit_counts(refs: Sequence[str], hyps: Sequence[str], unit: str) -> list[tuple[int, int]]:
    """(errors, reference length) per pair, in words (unit="word") or characters ("char")."""
    process = jiwer.process_words if unit == "word" else jiwer.process_characters

    def length(text: str) -> int:
        return len(text.split()) if unit == "word" else len(text)

    # An empty reference (jiwer refuses it) makes every hypothesis unit an insertion.
    counts = [(length(h), 0) for h in hyps]
    scorable = [i for i, r in enumerate(refs) if r.strip()]
    if scorable:
        out = process([refs[i] for i in scorable], [hyps[i] for i in scorable])
        for i, chunks in zip(scorable, out.alignments, strict=True):
            errors = ref_len = 0
            for c in chunks:
                ref_span, hyp_span = (
                    c.ref_end_idx - c.ref_start_idx,
                    c.hyp_end_idx - c.hyp_start_idx,
                )
                ref_len += ref_span
                errors += hyp_span if c.type == "insert" else (0 if c.type == "equal" else ref_span)
            counts[i] = (errors, ref_len)
    return counts


def rate(errors: int, length: int) -> float | None:
    return errors / length if length else None


def score(transcripts: Sequence[Transcript]) -> dict:
    refs = [t.reference for t in transcripts]
    hyps = [t.hypothesis for t in transcripts]
    words = edit_counts(refs, hyps, "word")
    chars = edit_counts(refs, hyps, "char")
    by_speaker: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t, (err, n) in zip(transcripts, words, strict=True):
        by_speaker[t.speaker][0] += err
        by_speaker[t.speaker][1] += n
    speaker_counts = {s: (e, n) for s, (e, n) in sorted(by_speaker.items())}
    per_speaker = {s: rate(e, n) for s, (e, n) in speaker_counts.items()}
    speaker_wers = [w for w in per_speaker.values() if w is not None]
    return {
        "wer": rate(sum(e for e, _ in words), sum(n for _, n in words)),
        "cer": rate(sum(e for e, _ in chars), sum(n for _, n in chars)),
        "speaker_wer_mean": statistics.fmean(speaker_wers) if speaker_wers else None,
        "speaker_wer_std": statistics.pstdev(speaker_wers) if speaker_wers else None,
        "speaker_wer_p10": _quantile(speaker_wers, 0.1),
        "speaker_wer_p50": statistics.median(speaker_wers) if speaker_wers else None,
        "speaker_wer_p90": _quantile(speaker_wers, 0.9),
        "num_speakers": len(per_speaker),
        "speakers_without_words": len(per_speaker) - len(speaker_wers),
        "num_utterances": len(transcripts),
        "num_words": sum(n for _, n in words),
        "per_speaker": per_speaker,
        "speaker_counts": speaker_counts,
        "utterances": [
            {
                "utt_id": t.utt_id,
                "speaker": t.speaker,
                "hypothesis": t.hypothesis,
                "word_errors": we,
                "words": wn,
                "char_errors": ce,
                "chars": cn,
            }
            for t, (we, wn), (ce, cn) in zip(transcripts, words, chars, strict=True)
        ],
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ----------------------------------------------------------------------------------------------
# Transcribing a store


@torch.no_grad()
def transcribe(
    model: CTCTransformer, utterances: Iterable, tokenizer, *, device, batch_seconds: float = 200.0
) -> list[Transcript]:
    """Greedy transcripts of utterances, streamed in chunks of 512, batched by similar length."""
    was_training = model.training
    model.eval()
    out: list[Transcript] = []
    for chunk in chunks(utterances, 512):
        for idx in dynamic_batches([u.seconds for u in chunk], batch_seconds):
            batch = collate([chunk[i] for i in idx]).to(device)
            log_probs, out_lens = model(batch.feats, batch.feat_lens)
            hyps = greedy_decode(log_probs, out_lens, tokenizer)
            out += [
                Transcript(u, s, r, h)
                for u, s, r, h in zip(batch.utt_ids, batch.user_ids, batch.texts, hyps, strict=True)
            ]
    model.train(was_training)
    return out


def group_counts(
    speaker_counts: dict[str, tuple[int, int]], groups: dict[str, dict[str, str]]
) -> dict[str, dict[str, dict]]:
    """Per attribute and group: pooled word errors / words over the group's speakers (its WER)
    and how many speakers it has. `groups`: attribute -> speaker -> group (speaker_groups);
    a speaker the attribute does not cover is counted as "unreported"."""
    out: dict[str, dict[str, dict]] = {}
    for attribute, of_speaker in sorted(groups.items()):
        pooled: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for speaker, (errors, words) in speaker_counts.items():
            g = pooled[of_speaker.get(speaker, "unreported")]
            g[0], g[1], g[2] = g[0] + errors, g[1] + words, g[2] + 1
        out[attribute] = {
            name: {"errors": e, "words": n, "speakers": k, "wer": rate(e, n)}
            for name, (e, n, k) in sorted(pooled.items())
        }
    return out


def evaluate(model: CTCTransformer, store, tokenizer, *, device, batch_seconds=200.0) -> dict:
    """One eval set (a feature store): its transcripts scored (`score`)."""
    return score(transcribe(model, store, tokenizer, device=device, batch_seconds=batch_seconds))


def evaluate_sets(model: CTCTransformer, stores: dict, tokenizer, *, device) -> dict[str, dict]:
    return {
        name: evaluate(model, store, tokenizer, device=device) for name, store in stores.items()
    }


def evaluate_task(
    model: CTCTransformer, data, eval_sets: Sequence, roles: set[str], device
) -> dict:
    """A task's eval sets of the given roles ("dev", "test"), each scored with its role and its
    per-group counts (speaker attributes from the task's data)."""
    chosen = [e for e in eval_sets if e.role in roles]
    stores = {e.name: data.eval_sets[e.name] for e in chosen}
    results = evaluate_sets(model, stores, data.tokenizer, device=device)
    return {
        e.name: with_groups(e.role, results[e.name], data.eval_groups.get(e.name, {}))
        for e in chosen
    }


def with_groups(role: str, result: dict, groups: dict[str, dict[str, str]]) -> dict:
    """One eval set's `score` with its role and per-group counts: what a run records of it (and
    what re-scoring its stored hypotheses must give again)."""
    return {"role": role, **result, "groups": group_counts(result["speaker_counts"], groups)}


# ----------------------------------------------------------------------------------------------
# What records keep of an evaluation


SUMMARY_KEYS = (  # what a record keeps of an evaluation (evaluate.score) per eval set
    "cer",
    "speaker_wer_mean",
    "speaker_wer_p10",
    "speaker_wer_p50",
    "speaker_wer_p90",
    "num_utterances",
)


def eval_summary(results: dict) -> dict:
    """evaluate_task's results, reduced to a record's EvalResult fields (JSON-ready)."""
    return {
        name: {
            "role": r["role"],
            "wer": r["wer"],
            **{key: r[key] for key in SUMMARY_KEYS},
            "speakers": r["speaker_counts"],
            "groups": r["groups"] or None,
        }
        for name, r in results.items()
    }


def seed_model_summary(model, data, config, device: str, seed_path) -> dict:
    """The starting model's dev/test summary. Every run of a task starts from the same seed
    model, so its evaluation is cached next to the checkpoint, keyed by the eval sets' data and
    by what else decides the numbers: the numerics version (how hypotheses are scored) and the
    device type (CUDA evaluates under bf16 autocast). A key without them let a run of numerics v3
    file the seed model's CER as v2 had scored it."""
    eval_sets = {e.name: [e.role, data.eval_sets[e.name].digest] for e in config.task.eval_sets}
    key = canonical_json(
        {
            "pflbench": __version__, "numerics": NUMERICS_VERSION,
            "device": torch.device(device).type, "eval_sets": eval_sets, "summary": "p50",
        }
    )  # fmt: skip
    cache = None
    if seed_path is not None:
        cache = Path(seed_path).with_name(
            f"eval-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        )
        if cache.is_file():
            return json.loads(cache.read_text())
    summary = eval_summary(
        evaluate_task(model, data, config.task.eval_sets, {"dev", "test"}, device)
    )
    if cache is not None:
        atomic_write_text(cache, json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary
