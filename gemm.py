"""Linears of a CPU step of several rows, and of a prefill, through oneDNN with prepacked weights, where the
machine says so.

A step of a few rows multiplies each weight matrix by a handful of activation rows. For fp32 weights, PyTorch's
CPU matmul (MKL's sgemm) and the frozen compile kinds' prepacked MKL GEMM (inductor's choice for fp32) handle
one row well and several rows poorly; oneDNN's matmul on a weight packed ahead of time for that many rows does
several well. Measured on an AMD EPYC with AVX-512 BF16, one thread, a compiled frozen vanilla step of
SmolLM2-135M over 8 rows: 98 ms with inductor's MKL-packed linears, 61 ms with these (one row: 41 against 50, so
there one row keeps the compile kind's). bf16 weights: the frozen kinds' graphs pack them for oneDNN themselves,
so only the prefills (eager, or compiled in the default kind) and the default kind's graphs take these; an eager
bf16 prefill of 60 tokens there runs 114 ms against F.linear's 137.

    rows = gemm.pack_linears(model, frozen=True)  # once, before compiling (engine.Engine does it for its steps)
    # then a linear over at least `rows` rows (a step of that many rows, a prefill) runs packed; None: nothing

`pack_linears` measures the choice on the machine at hand (`packed_from_rows`): the model's LM head, its
largest linear, timed both ways at 1, 2, 4 and 8 rows; the packed path starts at the first row count where it
is faster, or never. The packed weights are opaque oneDNN tensors that torch.compile cannot trace, so a linear
calls them through the custom op `eagle::packed_linear`, which compiled graphs keep as one opaque call, and
finds its weight by index in PACKED. They are copies: the model's weights stay (training, the quantizer, an
EAGLE head's LM-head rows read them), so packing costs the model's size again in memory.
"""
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

PACKED: list = []  # oneDNN-packed weights, by PackedLinear.packed_index
PACKABLE = (torch.float32, torch.bfloat16)
PACK_ROWS = 8  # the row count the weights are packed for (oneDNN's choice of blocking; any count runs)


# eagle::packed_linear, defined through torch.library.Library: a call costs ~3 us over the kernel's own, where
# torch.library.custom_op's wrapper costs ~14 (151 linears a step)
LIBRARY = torch.library.Library("eagle", "DEF")
LIBRARY.define("packed_linear(Tensor x, Tensor weight, int index) -> Tensor")


def packed_linear(x: Tensor, weight: Tensor, index: int) -> Tensor:
    """x [rows, in] @ weight.T through PACKED[index], weight's oneDNN-packed copy (weight itself is not read)."""
    return torch.ops.mkldnn._linear_pointwise(x, PACKED[index], None, "none", [], "")


def packed_linear_shape(x: Tensor, weight: Tensor, index: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


LIBRARY.impl("packed_linear", packed_linear, "CPU")
torch.library.register_fake("eagle::packed_linear", packed_linear_shape, lib=LIBRARY)


def tracing_frozen_graph() -> bool:
    """Whether this call is being traced for a graph compiled with frozen weights (engine.compile_step sets inductor's
    `freezing` while Dynamo traces): there inductor packs or lowers a plain linear itself."""
    return torch.compiler.is_compiling() and torch._inductor.config.freezing


class PackedLinear(nn.Linear):
    """An nn.Linear that multiplies `from_rows` rows or more through its oneDNN-packed copy; fewer rows take
    F.linear (what the compile kind makes of it), and so do graphs compiled with frozen weights where
    `inductor_packs` (bf16 weights: inductor packs them for oneDNN itself there; a compiled prefill, not frozen,
    takes this copy). The row count is static in a compiled step, so each step's graph holds one path."""
    packed_index: int
    from_rows: int
    inductor_packs: bool

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[:-1].numel()
        if (self.inductor_packs and tracing_frozen_graph()) or rows < self.from_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.eagle.packed_linear(x.reshape(rows, x.shape[-1]), self.weight, self.packed_index)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def median_ms(run, repeats: int = 7) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def packed_from_rows(weight: Tensor, frozen: bool, counts=(1, 2, 4, 8)) -> Optional[int]:
    """The least row count (of counts) from which the oneDNN-packed weight multiplies faster than the compile
    kind's own GEMM (frozen fp32: inductor's MKL-packed one; else ATen's matmul), None where it never is."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    with torch.no_grad():
        for rows in counts:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            if frozen and torch._C.has_mkl and weight.dtype == torch.float32:
                mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                theirs = median_ms(lambda: torch.ops.mkl._mkl_linear(x, mkl, weight, None, rows))
            else:
                theirs = median_ms(lambda: F.linear(x, weight))
            if median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")) < theirs:
                return rows
    return None


@torch.no_grad()
def pack_linears(model: nn.Module, frozen: bool) -> Optional[int]:
    """Make every fp32 or bf16 CPU nn.Linear of model a PackedLinear (once; later calls return the first answer),
    from the row count packed_from_rows measures on the model's LM head (frozen: for the frozen compile kinds);
    returns that count (None: nothing packed). Without oneDNN, or for other weights, nothing changes."""
    if hasattr(model, "packed_from_rows"):
        return model.packed_from_rows
    weight = model.output.weight.detach()
    usable = torch.backends.mkldnn.is_available() and packable(weight)
    model.packed_from_rows = packed_from_rows(weight, frozen) if usable else None
    if model.packed_from_rows is None:
        return None
    for linear in model.modules():
        if type(linear) is nn.Linear and packable(linear.weight.detach()):
            pack(linear, model.packed_from_rows, inductor_packs=frozen and linear.weight.dtype == torch.bfloat16)
    return model.packed_from_rows


def packable(weight: Tensor) -> bool:
    """A plain fp32 or bf16 CPU tensor: not a quantized tensor subclass (an int4 weight reports bf16)."""
    return type(weight) is Tensor and weight.dtype in PACKABLE and weight.device.type == "cpu"


def pack(linear: nn.Linear, from_rows: int, inductor_packs: bool = False) -> PackedLinear:
    """Turn linear into a PackedLinear over its weight's oneDNN-packed copy (see PackedLinear)."""
    PACKED.append(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS))
    linear.__class__ = PackedLinear
    linear.packed_index, linear.from_rows, linear.inductor_packs = len(PACKED) - 1, from_rows, inductor_packs
    return linear
