"""--device is checked the same way by every command that takes it (cli.common.check_device)."""

import pytest
import torch
from typer.testing import CliRunner

from pflbench.cli import app
from pflbench.cli.common import check_device
from pflbench.errors import UserError

COMMANDS = [
    ["run", "--task", "synth-cv-en-ls-seed", "--baseline", "fedavg"],
    ["seed", "--task", "synth-cv-en-ls-seed"],
    ["eval", "--task", "synth-cv-en-ls-seed", "--checkpoint", "missing.safetensors"],
    ["bench", "model"],
    ["bench", "fl"],
    ["sweep", "--task", "synth-cv-en-ls-seed", "--baselines", "fedavg", "--dry-run"],
]


@pytest.mark.parametrize(
    "command", COMMANDS, ids=lambda c: c[0] if c[0] != "bench" else " ".join(c[:2])
)
@pytest.mark.parametrize(
    "device, needle",
    [
        ("gpu", "expected cpu, cuda or cuda:N"),
        ("cuda:x", "expected cpu, cuda or cuda:N"),
        ("cuda:0" if not torch.cuda.is_available() else "cuda:99", "cuda:"),
    ],
)
def test_every_command_checks_the_device_alike(command, device, needle):
    # a UserError (which `pflbench` prints without a traceback and exits 2 on), before any work
    result = CliRunner().invoke(app, [*command, "--device", device])
    assert isinstance(result.exception, UserError), result.output
    assert str(result.exception).startswith("--device")
    assert needle in str(result.exception)


def test_check_device_accepts_what_it_documents():
    assert check_device("cpu") == "cpu"
    with pytest.raises(UserError, match="no CUDA GPU" if not torch.cuda.is_available() else "GPU"):
        check_device("cuda:0" if not torch.cuda.is_available() else "cuda:99")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_by_index_is_for_one_process():
    assert check_device("cuda:0") == "cuda:0" and check_device("cuda") == "cuda"
    with pytest.raises(UserError, match="local rank"):
        check_device("cuda:0", processes=2)
