"""Issue 26's GPU figures, prepared for a lent device machine's short time (15 minutes a session).

Each part fits one device call (at most 10 minutes; each command has its own time cap and the
part stops starting commands 40 s before its end). The device's python3 has PyTorch with CUDA;
the rest of pflbench comes from the kit `scripts/device_kit.py` builds here (`.device/kit`), which
this script installs into /tmp/site first. Results go to $OUT (what comes back from the device):
`<part>.jsonl`, one line per command (the command, its exit status, seconds, and its JSON output
or the tail of its log), and `<part>.log`, everything printed.

    bench   bench model and bench fl on paper-255m in bf16, compiled against eager (one client
            at a time, and 4 at once): MFU, time outside client training, memory vs cohort, the
            extrapolated GPU-hours of the paper's run
    tests   the test suite with CUDA available, then the embedded default run on the GPU

The device tool's call, from this repository's root here (carry names the kit):

    run(command="python3 scripts/device_figures.py bench", carry=[".device"], timeout_s=600)

On a CPU (`--device cpu`, the kit not installed) it runs the same commands on small settings,
which checks the plumbing before device time is spent on it: the commands start, print JSON, and
one over its cap is recorded as such (on the 2-core machine the bench part takes ~9 minutes,
its `bench fl` runs over their caps while a sweep holds the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")
BUDGET = 560  # seconds a part may run by default: a device call's 600 less python's and pip's start
MARGIN = 40  # no command starts this close to the end


def pflbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "pflbench", *args]


def commands(part: str, device: str) -> list[tuple[list[str], int]]:
    """(command, time cap in seconds) of a part; on a CPU the small settings."""
    gpu = device != "cpu"
    paper = ["--preset", "paper-255m"] if gpu else ["--preset", "synth-cpu"]
    # 2026-11-27, an H200: `bench fl --compile` at cohort 16 and 10 local steps ran past 215 s
    # (its eager twin alone takes 3 central steps of ~14 s, then memory at cohorts 8 and 64), so
    # the compiled figures take cohort 8 and 4 local steps.
    cohort = (
        ["--cohort", "8", "--local-steps", "4"] if gpu else ["--cohort", "2", "--local-steps", "2"]
    )
    if part == "bench":  # each --compile run times the eager step beside the compiled one
        # Eager first, alone: its figures (MFU, outside share, memory, GPU-hours) come back even
        # where compilation outlasts its cap, as it did on 2026-11-27.
        return [
            (pflbench("bench", "fl", "--device", device, *paper, *cohort, "--json"), 90),
            (pflbench("bench", "fl", "--device", device, *paper, *cohort, "--compile", "--json"),
             300),
            (
                pflbench("bench", "fl", "--device", device, *paper, "--dropout", "0",
                         "--layer-drop", "0", "--cohort", "8" if gpu else "2", "--local-steps", "2",
                         "--parallel-clients", "4" if gpu else "2", "--compile", "--json"),
                220,
            ),
            (pflbench("bench", "model", "--device", device, "--compile", "--json", *paper), 150),
        ]  # fmt: skip
    if part == "tests":
        workers = str(min(8, os.cpu_count() or 1))
        return [
            ([sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "no:cacheprovider"], 330),
            (pflbench("run", "--task", "synth-cv-en-ls-seed", "--baseline", "perlayer-dim",
                      "--device", device, "--no-progress", "--out", "/tmp/pflbench-run"), 200),
        ]  # fmt: skip
    raise SystemExit(f"unknown part {part!r}: bench or tests")


def install_kit() -> None:
    """The kit's wheels into /tmp/site (no index: the device reaches none)."""
    wheels = sorted(str(w) for w in (ROOT / ".device" / "kit").glob("*.whl"))
    if not wheels:
        raise SystemExit(
            "no kit in .device/kit: build it (.venv/bin/python scripts/device_kit.py); carry it"
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels],
        check=True,
    )  # fmt: skip


def environment(device: str) -> dict:
    """What the figures were measured on."""
    import torch

    facts = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                  "cuda": torch.version.cuda}  # fmt: skip
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["bench", "tests"])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument(
        "--budget", type=float, default=BUDGET,
        help="seconds the part may run (less where the session's device time is shorter)",
    )  # fmt: skip
    args = parser.parse_args()
    started = time.monotonic()
    out = Path(os.environ.get("OUT") or "/tmp/pflbench-device")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "benchmark")]
    if args.device != "cpu":
        install_kit()
        paths.insert(0, str(SITE))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path[:0] = paths  # for environment()'s torch, from the same place as the commands'
    log = (out / f"{args.part}.log").open("w")
    results = (out / f"{args.part}.jsonl").open("w")
    results.write(
        json.dumps({"environment": environment(args.device), "date": time.ctime()}) + "\n"
    )
    for command, cap in commands(args.part, args.device):
        left = args.budget - (time.monotonic() - started)
        if left < MARGIN:
            results.write(json.dumps({"command": command[1:], "skipped": "out of time"}) + "\n")
            continue
        began = time.monotonic()
        log.write(f"\n== {' '.join(command[1:])}\n")
        log.flush()
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=min(cap, left - MARGIN / 2),
            )  # fmt: skip
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = "timeout", exc.stdout or "", exc.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        log.write(stdout + stderr)
        log.flush()
        try:
            figures = json.loads(stdout)
        except ValueError:
            figures = None
        line = {"command": command[1:], "rc": rc, "seconds": round(time.monotonic() - began, 1)}
        line |= {"result": figures} if figures is not None else {"tail": (stdout + stderr)[-2000:]}
        results.write(json.dumps(line) + "\n")
        results.flush()
        print(json.dumps({k: v for k, v in line.items() if k != "tail"})[:3000], flush=True)


if __name__ == "__main__":
    main()
