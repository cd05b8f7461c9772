import os

import pytest
import torch

from tokenizer import ensure_default_model

torch.set_num_threads(min(2, len(os.sched_getaffinity(0))))  # never more threads than cores we may use


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
