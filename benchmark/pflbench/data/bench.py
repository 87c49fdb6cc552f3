"""`pflbench bench data`: feature extraction speed per core, per-user load time and synthesis
time of the data pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pflbench.data.prepare import prepare_task
from pflbench.spec.models import DataSource, EvalSet, Task


def timed_synthesis(out: Path, size: str, results: dict) -> Path:
    """Synthesizes English corpora of `size` into `out`, recording wall and CPU seconds (this
    process and the workers): the machine may be shared, the CPU seconds tell the cost."""
    import resource
    import time

    from pflbench.data.synth import synthesize

    def own_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    start, cpu_start, report = time.perf_counter(), own_cpu(), {}
    synthesize(out, "en", size, seed=0, report=report)
    results[f"synth_{size}_seconds"] = time.perf_counter() - start
    results[f"synth_{size}_cpu_seconds"] = own_cpu() - cpu_start + report["worker_cpu_seconds"]
    return out


def bench_data(include_small: bool = True) -> dict:
    """Feature extraction speed per core, per-user load time (small vs large user), synthesis
    time for tiny (and small) corpora. Prints and returns the figures."""
    import tempfile
    import time

    import torch

    from pflbench.data.audio import read_audio_file
    from pflbench.data.features import log_mel
    from pflbench.data.store import features_of

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict = {}
    wave = torch.randn(16000 * 60)
    start = time.perf_counter()
    for _ in range(5):
        log_mel(wave)
    results["log_mel_audio_seconds_per_second_per_core"] = 300 / (time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as tmp:
        root = timed_synthesis(Path(tmp) / "tiny", "tiny", results)
        clips = sorted((root / "cv-corpus-13.0-2023-03-09" / "en" / "clips").glob("*.mp3"))[:50]
        start, audio = time.perf_counter(), 0.0
        for clip in clips:
            audio += features_of(*read_audio_file(str(clip)))[1]
        results["mp3_decode_resample_features_audio_seconds_per_second_per_core"] = audio / (
            time.perf_counter() - start
        )
        torch.set_num_threads(threads)
        task = Task(
            name="bench", version=1, language="en", description="bench",
            federated_data=DataSource(corpus="commonvoice", subsets=["train"], locale="en"),
            eval_sets=[EvalSet(name="d", corpus="commonvoice", subset="dev", locale="en",
                               role="dev")],
        )  # fmt: skip
        store = prepare_task(task, root, Path(tmp) / "cache", progress=False).federated_train
        by_size = sorted(store.users(), key=store.user_num_utterances)
        for label, user in (("small", by_size[0]), ("large", by_size[-1])):
            store.load_user(user)  # map the shard once
            start = time.perf_counter()
            for _ in range(20):
                store.load_user(user)
            results[f"load_{label}_user"] = {
                "utterances": store.user_num_utterances(user),
                "seconds_of_audio": store.user_seconds(user),
                "load_ms": (time.perf_counter() - start) / 20 * 1000,
            }
        if include_small:
            timed_synthesis(Path(tmp) / "small", "small", results)
    results["cpu_cores"] = os.cpu_count()
    for key, value in results.items():
        print(f"{key}: {json.dumps(value, default=lambda x: round(x, 3))}")
    return results
