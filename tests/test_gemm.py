"""gemm.py: linears of several rows through oneDNN-packed weights give F.linear's numbers, eager and compiled; bf16
ones leave the frozen kinds' graphs to inductor and are packed in graphs not frozen (the compiled prefills)."""
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
    model.output = nn.Linear(64, 96, bias=False).to(torch.float16)
    assert gemm.pack_linears(model, frozen=True) is None and type(model.output) is nn.Linear


def graph_ops(fn, *args, frozen: bool = False) -> set:
    """The ops of the graph torch.compile captures for fn(*args) (frozen: traced as the frozen kinds' steps are,
    under inductor's freezing setting)."""
    seen = set()

    def backend(gm, inputs):
        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with torch._inductor.config.patch(freezing=frozen):
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return seen


def test_bf16_packed_linear_runs_eager_and_unfrozen_and_leaves_frozen_graphs_to_inductor():
    if not torch.backends.mkldnn.is_available():
        return
    torch.manual_seed(0)
    inductor_packs = gemm.pack(nn.Linear(64, 96).to(torch.bfloat16), from_rows=2, inductor_packs=True)
    everywhere = gemm.pack(nn.Linear(64, 96).to(torch.bfloat16), from_rows=2)
    with torch.no_grad():
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        for linear in (inductor_packs, everywhere):  # 5 rows: packed; its numbers are F.linear's up to bf16 rounding
            want = F.linear(x.float(), linear.weight.float(), linear.bias.float())
            torch.testing.assert_close(linear(x).float(), want, rtol=2e-2, atol=2e-2)
        assert "eagle.packed_linear" in graph_ops(everywhere, x, frozen=True)
        assert "eagle.packed_linear" not in graph_ops(inductor_packs, x, frozen=True)
        assert "eagle.packed_linear" in graph_ops(inductor_packs, x)  # a graph not frozen: the compiled prefills
        assert "eagle.packed_linear" not in graph_ops(everywhere, x[:1])  # fewer rows than from_rows


def test_packing_skips_a_quantized_lm_head():
    """An int4 model (its LM head quantized too: a tensor subclass that reports bf16) packs nothing and runs."""
    import quantize
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=128, n_layer=1, n_head=4, n_local_heads=2, intermediate_size=256,
                                  vocab_size=256)).to(torch.bfloat16).eval()
    quantize.quantize_model(model, quantize.handler_for("int4", 32), quantize_lm_head=True)
    assert gemm.pack_linears(model, frozen=True) is None
    assert not any(isinstance(m, gemm.PackedLinear) for m in model.modules())
