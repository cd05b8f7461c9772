import os

import pytest
import torch

from scripts.convert_gguf import ensure_default_model

torch.set_num_threads(min(2, len(os.sched_getaffinity(0))))  # never more threads than cores we may use


@pytest.fixture(scope="session")
def default_checkpoint():
    """model.pth of the default SmolLM2-135M-Instruct, converted from the packaged GGUF once."""
    return ensure_default_model()
