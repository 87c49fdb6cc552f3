"""CLI: `bench` — speed and memory figures, printed (never asserted by timed tests)."""

from __future__ import annotations

import typer
from rich.table import Table

from pflbench.cli.common import (
    DeviceOption,
    JsonOption,
    check_device,
    console,
    err_console,
    print_json,
)


def _print(title: str, figures: dict, as_json: bool) -> None:
    if as_json:
        print_json(figures)
        return
    table = Table(title=title, show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in _flatten(figures).items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def register(app: typer.Typer) -> None:
    bench = typer.Typer(
        help="Benchmarks that print speed and memory figures.", no_args_is_help=True
    )
    app.add_typer(bench, name="bench")

    @bench.command("privacy")
    def bench_privacy(as_json: bool = JsonOption) -> None:
        """Time of one ε at T = 2000 (target < 1 s) and one calibration (target < 10 s)."""
        from pflbench.privacy.bench import bench_privacy

        _print("privacy accounting", bench_privacy(), as_json)

    @bench.command("data")
    def bench_data(
        small: bool = typer.Option(True, help="Also time `data synth --size small` (minutes)."),
        as_json: bool = JsonOption,
    ) -> None:
        """Feature extraction speed, per-user load time, synthesis time."""
        from pflbench.data.bench import bench_data

        _print("data pipeline", bench_data(include_small=small), as_json)

    @bench.command("model")
    def bench_model(
        device: str = DeviceOption,
        preset: str = typer.Option(
            None, help="Model preset (default: synth-cpu on CPU, paper-255m on CUDA)."
        ),
        steps: int = typer.Option(None, min=1, help="Timed steps (default: 4 on CPU, 10 on CUDA)."),
        compile_step: bool = typer.Option(
            False,
            "--compile",
            help="Also time the step under torch.compile (speed-up, compile time).",
        ),
        as_json: bool = JsonOption,
    ) -> None:
        """Training throughput (s of audio per s); on CUDA also MFU in bf16; on CPU also CPU
        seconds per step and the trained weights' digest (equal digests: the same floats)."""
        from pflbench.model.bench import bench_model

        check_device(device)
        preset = preset or ("paper-255m" if device.startswith("cuda") else "synth-cpu")
        backend = "inductor" if compile_step else None
        figures = bench_model(device=device, preset=preset, steps=steps, compile_backend=backend)
        _print(f"model {preset} on {device}", figures, as_json)

    @bench.command("fl")
    def bench_fl(
        preset: str = typer.Option(
            None, help="Model preset (default: synth-cpu on CPU, paper-255m on CUDA)."
        ),
        device: str = DeviceOption,
        cohort: int = typer.Option(8, help="Cohort size of the measured central steps."),
        local_steps: int = typer.Option(10, help="Local steps per client."),
        parallel_clients: int = typer.Option(
            1,
            "--parallel-clients",
            min=1,
            help="Also time G clients at once (vmap) against one at a time.",
        ),
        dropout: float = typer.Option(None, help="Override the preset's dropout (e.g. 0)."),
        layer_drop: float = typer.Option(None, help="Override the preset's layer drop."),
        compile_step: bool = typer.Option(
            False,
            "--compile",
            help="Compile the local step (torch.compile; the loss under CUDA graphs on CUDA) and"
            " time it against the eager step (speed-up, compile time).",
        ),
        as_json: bool = JsonOption,
    ) -> None:
        """Local-step time, MFU, time per central step, overhead outside client training,
        peak memory at two cohort sizes, and extrapolated GPU-hours for the paper's run."""
        from pflbench.fl.bench import bench_fl

        check_device(device)
        preset = preset or ("paper-255m" if device.startswith("cuda") else "synth-cpu")
        figures = bench_fl(
            preset, device, cohort, local_steps, parallel_clients, dropout, layer_drop,
            compile_backend="inductor" if compile_step else None,
            report=lambda line: err_console.print(line, markup=False, highlight=False),
        )  # fmt: skip
        _print(f"federated step, {preset} on {device}", figures, as_json)

    @bench.command("results")
    def bench_results(as_json: bool = JsonOption) -> None:
        """Leaderboard regeneration time over 10,000 synthetic records (target < 5 s)."""
        from pflbench.results.bench import bench_results

        _print("results", bench_results(), as_json)
