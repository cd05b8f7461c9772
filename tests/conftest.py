import os

import pytest
import torch

from model import CheckpointError
from tokenizer import ensure_default_model

# never more threads than cores we may use; under pytest -n N (pytest-xdist) N worker processes share them, one
# thread each (a second thread on a core another worker keeps busy makes small steps several times slower)
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else min(2, len(os.sched_getaffinity(0))))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="where the tests marked `device` run (cpu, cuda); "
                     "scripts/gpu_check.py selects them with -m device --device cuda")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: a test that runs on --device (the GPU check selects these)")
    if WORKER is None and getattr(config.option, "numprocesses", None):  # -n: convert once, before workers start
        try:
            ensure_default_model()
        except CheckpointError:
            pass  # the tests that need the model say so themselves


@pytest.fixture(scope="session")
def device(request):
    """The --device the `device` tests run on (default cpu)."""
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.exit("--device cuda asked for, but this machine has no CUDA device", returncode=4)
    return name


@pytest.fixture(scope="session")
def default_checkpoint():
    """model.pth of the default SmolLM2-135M-Instruct, converted from the packaged GGUF once."""
    return ensure_default_model()


@pytest.fixture
def lean_torch():
    """One thread and no autograd: on two shared, busy cores a second thread makes batch-1 steps and
    small matmuls several times slower (measured 3-10x), not faster."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
