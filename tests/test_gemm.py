"""gemm.py: fp32 linears of several rows through oneDNN-packed weights give F.linear's numbers, eager and compiled."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import gemm


def test_packed_linear_equals_f_linear_eager_and_compiled():
    torch.manual_seed(0)
    model = nn.Module()
    model.output = nn.Linear(64, 96, bias=False)
    model.inner = nn.Linear(64, 64, bias=True)
    dense = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for name, m in (("output", model.output), ("inner", model.inner))}
    if not torch.backends.mkldnn.is_available():
        return
    from_rows = gemm.pack_linears(model, frozen=False)
    if from_rows is None:  # this machine's oneDNN never wins: nothing packed, nothing to compare
        assert type(model.inner) is nn.Linear
        return
    assert type(model.inner) is gemm.PackedLinear and gemm.pack_linears(model, frozen=True) == from_rows
    step = torch.compile(lambda x: model.inner(x), fullgraph=True, dynamic=False)
    with torch.no_grad():
        for rows in (1, 2, 8):
            x = torch.randn(rows, 1, 64)
            want = F.linear(x, *dense["inner"])
            torch.testing.assert_close(model.inner(x), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step(x), want, rtol=1e-5, atol=1e-5)


def test_packing_leaves_other_weights_alone():
    model = nn.Module()
    model.output = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    assert gemm.pack_linears(model, frozen=True) is None and type(model.output) is nn.Linear
