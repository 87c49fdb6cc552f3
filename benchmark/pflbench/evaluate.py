"""Evaluation: greedy CTC transcripts → WER/CER with jiwer on normalized text.

Reported per eval set:
- pooled WER/CER: total errors / total reference words (chars) over the set, the standard way;
- speaker-averaged WER: each speaker's own pooled WER, averaged with equal weight per speaker (the
  paper weights speakers equally), with its std, median and 90th percentile.

Empty texts are handled: an empty hypothesis counts every reference word as a deletion; an empty
reference counts every hypothesis word as an insertion. A speaker whose references are all empty
has no WER and is left out of the speaker average (counted in `speakers_without_words`); a set
with no reference words at all has WER None.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jiwer
import torch

from pflbench.data.batching import chunks, collate, dynamic_batches
from pflbench.model.transformer import CTCTransformer, greedy_decode


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
    per_speaker = {s: rate(e, n) for s, (e, n) in sorted(by_speaker.items())}
    speaker_wers = [w for w in per_speaker.values() if w is not None]
    return {
        "wer": rate(sum(e for e, _ in words), sum(n for _, n in words)),
        "cer": rate(sum(e for e, _ in chars), sum(n for _, n in chars)),
        "speaker_wer_mean": statistics.fmean(speaker_wers) if speaker_wers else None,
        "speaker_wer_std": statistics.pstdev(speaker_wers) if speaker_wers else None,
        "speaker_wer_median": statistics.median(speaker_wers) if speaker_wers else None,
        "speaker_wer_p90": _quantile(speaker_wers, 0.9),
        "num_speakers": len(per_speaker),
        "speakers_without_words": len(per_speaker) - len(speaker_wers),
        "num_utterances": len(transcripts),
        "num_words": sum(n for _, n in words),
        "per_speaker": per_speaker,
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


def evaluate(model: CTCTransformer, store, tokenizer, *, device, batch_seconds=200.0) -> dict:
    return score(transcribe(model, store, tokenizer, device=device, batch_seconds=batch_seconds))


def evaluate_sets(model: CTCTransformer, stores: dict, tokenizer, *, device) -> dict[str, dict]:
    return {
        name: evaluate(model, store, tokenizer, device=device) for name, store in stores.items()
    }


# ----------------------------------------------------------------------------------------------
# Throughput benchmark

# Dense bf16 peak FLOP/s by GPU name, for model-FLOPs utilization.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def bench_model(device: str = "cpu", preset: str = "synth-cpu", steps: int | None = None) -> dict:
    """Training throughput on random 5 s utterances: seconds of audio per second, and on CUDA the
    model-FLOPs utilization (bf16 autocast) at the paper's 120 s batch (60 s on CPU)."""
    from pflbench.central import make_central_optimizer
    from pflbench.model.transformer import (
        build_model,
        count_parameters,
        ctc_loss,
        model_flops_per_frame,
    )
    from pflbench.spec.models import CentralRecipe

    cuda = device.startswith("cuda")
    batch_seconds, utt_seconds = (120.0 if cuda else 60.0), 5.0
    batch, frames_in = int(batch_seconds / utt_seconds), int(utt_seconds * 100)
    steps = steps or (10 if cuda else 4)
    torch.manual_seed(0)
    model = build_model(preset, vocab_size=30).to(device).train()
    opt = make_central_optimizer(model.named_parameters(), CentralRecipe())
    feats = torch.randn(batch, frames_in, 80, device=device)
    feat_lens = torch.full((batch,), frames_in, device=device)
    targets = torch.randint(1, 30, (batch, int(utt_seconds * 15)), device=device)
    target_lens = torch.full((batch,), targets.shape[1], device=device)

    def step() -> None:
        log_probs, out_lens = model(feats, feat_lens)
        ctc_loss(log_probs, out_lens, targets, target_lens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: allocations, kernels
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_seconds = (time.perf_counter() - t0) / steps
    frames_out = int(model.output_lengths(feat_lens[:1]).item())
    flops = model_flops_per_frame(model.cfg, 30, frames_out) * frames_out * batch / step_seconds
    out = {
        "preset": preset,
        "device": torch.cuda.get_device_name()
        if cuda
        else f"cpu ({torch.get_num_threads()} threads)",
        "parameters_m": count_parameters(model) / 1e6,
        "batch_seconds_of_audio": batch_seconds,
        "step_seconds": step_seconds,
        "audio_seconds_per_second": batch_seconds / step_seconds,
        "model_tflops_per_second": flops / 1e12,
    }
    if cuda:
        peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
        out["mfu"] = flops / peak if peak else None
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out
