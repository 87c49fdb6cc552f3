"""Progress outside a terminal: full lines a log keeps, every few seconds and at the end."""

import io

from rich.progress import Progress

from pflbench.progress import LineProgress, make_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_full_lines_and_a_terminal_a_bar():
    assert isinstance(make_progress("x", file=io.StringIO()), LineProgress)
    assert isinstance(make_progress("x", file=_Terminal()), Progress)
    # disabled: nothing is printed, whatever the output is
    out = io.StringIO()
    with make_progress("x", enabled=False, file=out) as progress:
        progress.update(progress.add_task("a", total=1), advance=1)
    assert out.getvalue() == ""


def test_lines_are_complete_and_periodic():
    out = io.StringIO()
    long_text = "loss 12.345  ε 7.2  1.23 s/step " + "x" * 120  # wider than any terminal
    with LineProgress("federated", file=out, every=3600) as progress:
        task = progress.add_task("", total=200, completed=50)
        for _ in range(10):
            progress.update(task, advance=1, description=long_text)
    lines = out.getvalue().splitlines()
    # nothing within the period; the state reached when the block ends, in full
    assert len(lines) == 1
    assert lines[0].startswith("federated  60/200 (30%)  elapsed 0:00:00 eta ")
    assert lines[0].endswith(long_text)


def test_every_period_and_the_end_print_a_line():
    out = io.StringIO()
    with LineProgress("seed", file=out, every=0) as progress:
        task = progress.add_task("train", total=3, info="")
        for step in range(3):
            progress.update(task, advance=1, info=f"loss {step}")
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["1/3 (33%)", "2/3 (67%)", "3/3 (100%)"]
    assert lines[-1].endswith("train  loss 2") and "eta" not in lines[-1]
    # a task without a total counts up
    out = io.StringIO()
    with LineProgress("synthesis", file=out, every=0) as progress:
        progress.update(progress.add_task("units"), completed=5)
    assert out.getvalue().startswith("synthesis  5  elapsed")


def test_the_end_is_printed_once_when_it_is_reported_twice():
    """A feature store reports its last shard, then the caller sets the bar to its total."""
    out = io.StringIO()
    with LineProgress("data", file=out, every=3600) as progress:
        task = progress.add_task("features seed", total=4)
        progress.update(task, completed=4)
        progress.update(task, completed=4)
    assert len(out.getvalue().splitlines()) == 1
