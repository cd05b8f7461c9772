"""Weight-only int8 and int4 quantization of a target model, and w8a8 (int8 weights and activations), with
torchao's tensor subclasses.

    python quantize.py --mode int8                      # -> model_int8.pth beside model.pth
    python quantize.py --mode w8a8                      # -> model_w8a8.pth: activations int8 too, per token
    python quantize.py --mode int4 --groupsize 32       # -> model_int4.g32.pth, packed for CPU
    python quantize.py --mode int4 --device cuda        # the same, packed for CUDA (tinygemm)
    python generate.py --checkpoint .../model_int4.g32.pth --dtype bfloat16 --eagle

One handler class per scheme, each wrapping a torchao configuration: int8
(`Int8WeightOnlyConfig`, one scale per output row: one file for any device) and int4 (a scale and zero
point per `groupsize` inputs in the tinygemm layout of one device type: `PrototypeInt4WeightOnlyConfig`
on CPU, `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")` on CUDA, bfloat16 only), and w8a8
(`Int8DynamicActivationInt8WeightConfig`: int8 weights per row, activations int8 per token at each call).
On CPU the linears then call ATen's or oneDNN's kernels themselves, on plain buffers (`Int8CPULinear`,
`Int4CPULinear`, `W8A8CPULinear`; why, and the accuracy of each scheme: docs/quantization.md). A file runs
in the activation dtype it was quantized in; its device type, dtype and group size are recorded in it and
checked on load.

Every nn.Linear of the decoder is quantized; the token embedding and, unless --quantize_lm_head, the LM
head stay in float (a quantized LM head of tied embeddings is a copy of the shared matrix). An EAGLE head
on an int4 target is quantized the same way as it loads (its linears and its rows of the LM head); on an
int8 or w8a8 target it stays in float.

File layout: {"quantization": {mode, groupsize, device ("cpu" / "cuda" / "any"), dtype, lm_head,
torchao version}, "state_dict": the model's state dict}. `dequantized` turns any of these weights back
into a plain tensor (the EAGLE head's draft vocabulary takes rows of the LM head).
"""
import argparse
import logging
import re
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gemm import tracing_frozen_graph
from model import DTYPES, CheckpointError, ModelArgs, Transformer


class KnownImportNoise(logging.Filter):
    """Drops two log lines that every import of torchao 0.18 under torch 2.13's CPU build prints and that
    say nothing about this program: its CUDA-only extensions (mxfp8, cutlass sm90a) do not load without
    CUDA, and torch deprecates torchao's register_constant() on an Enum. Every other record passes."""
    NOISE = ("_C_mxfp8.", "_C_cutlass_90a.", "is an Enum subclass and is now natively supported")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in record.getMessage() for s in self.NOISE)


for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(KnownImportNoise())
# registers torch.ops.quantized_decomposed, the ops of W8A8CPULinear.decomposed (torchao happens to import it too)
import torch.ao.quantization.fx._decomposed  # noqa: E402,F401
import torchao  # noqa: E402
from torchao.prototype.quantization.int4 import Int4OpaqueTensor, PrototypeInt4WeightOnlyConfig  # noqa: E402
from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,  # noqa: E402
                                  Int8WeightOnlyConfig, quantize_)
from torchao.quantization.granularity import PerRow  # noqa: E402
from torchao.quantization.quantize_.workflows import Int4TilePackedTo4dTensor, Int8Tensor  # noqa: E402

QUANTIZED_NAME = re.compile(r"model_(int8|int4|w8a8)(?:\.g(\d+))?\.pth")  # what quantize.py writes


class QuantizeError(ValueError):
    """A model or a request that this scheme cannot quantize; the message says what to do."""


class Int8WeightOnly:
    """int8 weights, one scale per output row; the layout serves any device."""
    mode, groupsize, file_name = "int8", None, "model_int8.pth"

    def config(self, device_type: str):
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)

    def packed_for(self, device_type: str) -> str:
        return "any"

    def check_linear(self, name: str, linear: nn.Linear, device_type: str):
        pass

    def is_quantized(self, weight) -> bool:
        return isinstance(weight, Int8Tensor) and weight.act_quant_kwargs is None


class Int8DynamicActivation:
    """int8 weights, one scale per output row, and int8 activations, one scale per token computed at each call:
    the GEMM itself runs in integers (on CPU oneDNN's u8 x s8 kernel, W8A8CPULinear)."""
    mode, groupsize, file_name = "w8a8", None, "model_w8a8.pth"

    def config(self, device_type: str):
        return Int8DynamicActivationInt8WeightConfig(granularity=PerRow(), set_inductor_config=False)

    def packed_for(self, device_type: str) -> str:
        return "any"

    def check_linear(self, name: str, linear: nn.Linear, device_type: str):
        if device_type == "cpu" and not torch.backends.mkldnn.is_available():
            raise QuantizeError("w8a8 on CPU needs PyTorch's oneDNN (mkldnn) build; use int8 or int4")

    def is_quantized(self, weight) -> bool:
        return isinstance(weight, Int8Tensor) and weight.act_quant_kwargs is not None


class Int4WeightOnly:
    """int4 weights, a scale and zero point per `groupsize` inputs; tinygemm layout of one device type."""
    mode = "int4"

    def __init__(self, groupsize: int = 32):
        if groupsize not in (32, 64, 128):
            raise QuantizeError(f"--groupsize must be 32, 64 or 128, got {groupsize}")
        self.groupsize, self.file_name = groupsize, f"model_int4.g{groupsize}.pth"

    def config(self, device_type: str):
        if device_type == "cuda":
            return Int4WeightOnlyConfig(group_size=self.groupsize, int4_packing_format="tile_packed_to_4d",
                                        set_inductor_config=False)
        return PrototypeInt4WeightOnlyConfig(group_size=self.groupsize, set_inductor_config=False)

    def packed_for(self, device_type: str) -> str:
        return device_type

    def check_linear(self, name: str, linear: nn.Linear, device_type: str):
        out_features, in_features = linear.weight.shape
        if in_features % self.groupsize:
            raise QuantizeError(f"--groupsize {self.groupsize} does not divide the {in_features} inputs of {name}; "
                                f"use a group size that does (e.g. 32)")
        if device_type == "cpu" and out_features % 16:
            raise QuantizeError(f"{name} has {out_features} outputs; the CPU int4 kernel needs a multiple of 16")

    def is_quantized(self, weight) -> bool:
        return (isinstance(weight, (Int4OpaqueTensor, Int4TilePackedTo4dTensor))
                and weight.block_size[-1] == self.groupsize)


class CPUKernelLinear(nn.Linear):
    """An nn.Linear whose quantized weight multiplies through an ATen CPU kernel called directly on
    plain non-persistent buffers (the weight, and so the state dict and the saved file, is unchanged);
    a subclass's `kernel` maps [rows, in] to [rows, >= out] (padding columns are dropped)."""

    def kernel(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        y = self.kernel(x.reshape(-1, x.shape[-1]))[:, :self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8CPULinear(CPUKernelLinear):
    """torchao's Int8Tensor weight through ATen's CPU int8 kernel, which reads its int8 rows and its
    scales in the activation dtype."""

    @classmethod
    def convert(cls, linear: nn.Linear, dtype: torch.dtype):
        linear.__class__ = cls
        linear.register_buffer("int8_weight", linear.weight.qdata, persistent=False)
        linear.register_buffer("int8_scales", linear.weight.scale.reshape(-1).to(dtype).contiguous(), persistent=False)

    def kernel(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x, self.int8_weight, self.int8_scales)


# eagle_quant::int8_linear: oneDNN's int8 linear on a weight prepacked once (an opaque tensor torch.compile cannot
# trace, found by index in INT8_PACKED), so compiled graphs keep it as one call; the activations' quantization
# around it stays in the graph, where inductor fuses it
INT8_PACKED: list = []  # (prepacked int8 weight, its zero points) by W8A8CPULinear.packed_index
LIBRARY = torch.library.Library("eagle_quant", "DEF")
LIBRARY.define("int8_linear(Tensor xq, Tensor weight, Tensor scales, int index) -> Tensor")


def int8_linear(xq: Tensor, weight: Tensor, scales: Tensor, index: int) -> Tensor:
    """(xq [rows, in] uint8, 128 meaning 0) @ weight.T [in, out] int8, times scales [out]: fp32 [rows, out]."""
    packed, zeros = INT8_PACKED[index]
    return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, scales, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")


LIBRARY.impl("int8_linear", int8_linear, "CPU")
torch.library.register_fake("eagle_quant::int8_linear", lambda xq, weight, scales, index: xq.new_empty(
    xq.shape[0], weight.shape[0], dtype=torch.float32), lib=LIBRARY)


class W8A8CPULinear(CPUKernelLinear):
    """torchao's Int8Tensor weight with per-token int8 activations (Int8DynamicActivation) through oneDNN's int8
    linear: each row of x is scaled by its own absolute maximum / 127 and rounded, the integer products are
    summed exactly in int32 (so a row's result does not depend on the other rows) and scaled back by the weight
    row's and the token's scales."""

    @classmethod
    def convert(cls, linear: nn.Linear):
        linear.__class__ = cls
        weight = linear.weight
        linear.register_buffer("int8_weight", weight.qdata, persistent=False)
        linear.register_buffer("int8_scales", weight.scale.reshape(-1).float().contiguous(), persistent=False)
        linear.register_buffer("int8_zeros", torch.zeros(weight.qdata.shape[0], dtype=torch.int64), persistent=False)
        INT8_PACKED.append((torch.ops.onednn.qlinear_prepack(weight.qdata, None), linear.int8_zeros))
        linear.packed_index = len(INT8_PACKED) - 1

    def kernel(self, x: Tensor) -> Tensor:
        x32 = x.float()
        scale = (x32.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)  # one per token
        xq = (torch.round(x32 / scale) + 128).to(torch.uint8)  # 1..255
        if tracing_frozen_graph():
            y = self.decomposed(xq)
        else:
            y = torch.ops.eagle_quant.int8_linear(xq, self.int8_weight, self.int8_scales, self.packed_index)
        return (y * scale).to(x.dtype)

    def decomposed(self, xq: Tensor) -> Tensor:
        """The same integer product written as PT2E's quantized pattern (dequantize both sides, then a linear).
        In a graph compiled with frozen weights, inductor's quantization passes fold it into its own oneDNN int8
        linear on a weight it prepacks (no opaque call left, and under max-autotune its int8 GEMM template may
        take it); elsewhere the weight would be dequantized at every call, so only frozen graphs take this."""
        xd = torch.ops.quantized_decomposed.dequantize_per_tensor.default(xq, 1.0, 128, 0, 255, torch.uint8)
        w = torch.ops.quantized_decomposed.dequantize_per_channel.default(
            self.int8_weight, self.int8_scales, self.int8_zeros, 0, -128, 127, torch.int8)
        return F.linear(xd, w)


class Int4CPULinear(CPUKernelLinear):
    """torchao's Int4OpaqueTensor weight through the kernel call torchao makes itself, on plain tensors:
    the same numbers, with torch.compile's guards checked in C++, not in Python per tensor subclass."""

    @classmethod
    def convert(cls, linear: nn.Linear):
        linear.__class__ = cls
        linear.register_buffer("int4_weight", linear.weight.qdata, persistent=False)
        linear.register_buffer("int4_scales_zeros", linear.weight.scale_and_zero, persistent=False)
        linear.groupsize = linear.weight.block_size[1]

    def kernel(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.int4_weight, self.groupsize,
                                                 self.int4_scales_zeros)


def use_cpu_kernels(model: nn.Module):
    """On CPU, route every bfloat16 int8 linear of `model` through Int8CPULinear (the kernel's fp32
    path is slower than torchao's) and every weight-only int4 linear through Int4CPULinear; elsewhere
    there is nothing to do."""
    for linear in model.modules():
        if not isinstance(linear, nn.Linear) or isinstance(linear, CPUKernelLinear) or linear.weight.device.type != "cpu":
            continue
        weight = linear.weight
        if isinstance(weight, Int8Tensor) and weight.act_quant_kwargs is not None:
            W8A8CPULinear.convert(linear)
        elif isinstance(weight, Int8Tensor) and weight.dtype == torch.bfloat16:
            Int8CPULinear.convert(linear, torch.bfloat16)
        elif isinstance(weight, Int4OpaqueTensor) and weight.act_mapping_type is None and weight.act_pre_scale is None:
            Int4CPULinear.convert(linear)


def handler_for(mode: str, groupsize: Optional[int] = None):
    if mode not in ("int8", "int4", "w8a8"):
        raise QuantizeError(f"unknown quantization mode {mode!r}; use int8, int4 or w8a8")
    if mode != "int4" and groupsize is not None:
        raise QuantizeError(f"{mode} uses one scale per output row; --groupsize applies to int4 only")
    if mode == "w8a8":
        return Int8DynamicActivation()
    return Int8WeightOnly() if mode == "int8" else Int4WeightOnly(32 if groupsize is None else groupsize)


def linears_to_quantize(model: Transformer, quantize_lm_head: bool) -> dict:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (quantize_lm_head or name != "output")}


@torch.no_grad()
def quantize_model(model: Transformer, handler, quantize_lm_head: bool = False) -> dict:
    """Quantize `model` in place (on its device, in its dtype); returns the metadata for its file,
    also kept as `model.quantization`."""
    device_type = model.output.weight.device.type
    dtype = model.output.weight.dtype
    if device_type not in ("cpu", "cuda"):
        raise QuantizeError(f"quantization on {device_type} is not supported; use cpu or cuda")
    if handler.mode == "int4" and device_type == "cuda" and dtype != torch.bfloat16:
        raise QuantizeError("int4 on CUDA (tinygemm) needs bfloat16; use --dtype bfloat16")
    linears = linears_to_quantize(model, quantize_lm_head)
    for name, linear in linears.items():
        handler.check_linear(name, linear, device_type)
    if quantize_lm_head and model.output.weight is model.tok_embeddings.weight:
        model.output.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone(), requires_grad=False)
    quantize_(model, handler.config(device_type), filter_fn=lambda m, fqn: fqn in linears)
    model.quantization = {"mode": handler.mode, "groupsize": handler.groupsize,
                          "device": handler.packed_for(device_type), "dtype": str(dtype).removeprefix("torch."),
                          "lm_head": quantize_lm_head, "torchao": torchao.__version__}
    use_cpu_kernels(model)
    return model.quantization


def quantize_head_like(head, target: Transformer):
    """Bind an EAGLE head to a quantized target: to the float rows of its LM head (`dequantized`), and on
    an int4 target quantize the head to int4 too (see above); on an int8 target it stays in float."""
    if target.quantization is None:
        return
    head.bind(dequantized(target.output.weight))
    if target.quantization["mode"] == "int4":
        quantize_head(head, handler_for("int4", target.quantization["groupsize"]))


@torch.no_grad()
def quantize_head(head, handler):
    """Quantize an EAGLE head's linears in place, and its bound draft LM head `head.lm_head` (an EagleHead
    keeps it outside its modules) unless the kernel cannot take its rows (a draft vocabulary that is no
    multiple of 16 stays in float). On CPU they all run through the plain-buffer kernels, like the target's
    (Int4CPULinear), so no tensor subclass reaches a compiled graph."""
    device_type = head.fc.weight.device.type
    linears = {name: m for name, m in head.named_modules() if isinstance(m, nn.Linear)}
    for name, linear in linears.items():
        handler.check_linear(f"EAGLE head {name}", linear, device_type)
    quantize_(head, handler.config(device_type), filter_fn=lambda m, fqn: fqn in linears)
    use_cpu_kernels(head)
    if head.lm_head is not None and head.lm_head not in linears.values():
        try:
            handler.check_linear("EAGLE draft LM head", head.lm_head, device_type)
        except QuantizeError:
            return
        quantize_(head.lm_head, handler.config(device_type))
        use_cpu_kernels(head.lm_head)


def dequantized(weight: Tensor) -> Tensor:
    """A plain tensor of a linear weight as its linear computes it (torchao's int4 tensors have no
    dequantize): the linear of the identity. Plain tensors come back as they are."""
    if type(weight) in (Tensor, nn.Parameter):
        return weight
    identity = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    return F.linear(identity, weight).t().contiguous()


def save_quantized(model: Transformer, metadata: dict, path: Path):
    """Write {"quantization": metadata, "state_dict": ...}; tensors go to the CPU, packed layouts unchanged."""
    state = {name: t.to("cpu") for name, t in model.state_dict().items()}
    if model.output.weight is model.tok_embeddings.weight:
        state.pop("output.weight")
    torch.save({"quantization": metadata, "state_dict": state}, path)


def load_quantized(path: Path, device="cpu", dtype=None) -> Transformer:
    """Load a file written by save_quantized, refusing one packed for another device, dtype or group size.
    dtype: None (the file's) or the activation dtype asked for, which must be the file's."""
    path = Path(path)
    config = ModelArgs.from_checkpoint_dir(path.parent)
    try:
        with torch.serialization.safe_globals([Int4TilePackedTo4dTensor]):  # torchao registers the others
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}); quantize it again") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("quantization"), dict) or "state_dict" not in saved:
        raise CheckpointError(f"{path} is not a checkpoint written by quantize.py; quantize model.pth again")
    meta = saved["quantization"]
    handler = check_metadata(path, meta, torch.device(device).type, dtype)
    model = Transformer.from_state(config, saved["state_dict"], path, config.tie_embeddings and not meta["lm_head"],
                                   requires_grad=False)
    model.quantization = meta
    for name in linears_to_quantize(model, meta["lm_head"]):
        if not handler.is_quantized(model.get_submodule(name).weight):
            raise CheckpointError(f"{path}: {name}.weight is not {meta['mode']} with group size {meta['groupsize']} "
                                  "as its metadata says; quantize model.pth again")
    model = model.to(device).eval()
    use_cpu_kernels(model)
    return model


def check_metadata(path: Path, meta: dict, device_type: str, dtype: Optional[torch.dtype]):
    """The handler of a file's metadata, after checking it against its name, the device and the dtype."""
    try:
        mode, groupsize, packed_for, file_dtype = meta["mode"], meta["groupsize"], meta["device"], meta["dtype"]
        handler = handler_for(mode, groupsize)
        file_dtype = DTYPES[file_dtype]
    except (KeyError, QuantizeError) as e:
        raise CheckpointError(f"{path} has malformed quantization metadata ({e}); quantize model.pth again") from None
    name = QUANTIZED_NAME.fullmatch(path.name)
    name_groupsize = None if name is None or name[2] is None else int(name[2])
    if name is None or name[1] != mode or name_groupsize != groupsize:
        raise CheckpointError(f"{path.name} holds {mode} weights with group size {groupsize}, which its name "
                              f"contradicts; rename it {handler.file_name} or quantize again")
    if packed_for not in ("any", device_type):
        raise CheckpointError(f"{path.name} is packed for {packed_for} and cannot run on {device_type}; make one for "
                              f"{device_type} with: python quantize.py --mode {mode} --groupsize {groupsize} "
                              f"--device {device_type}")
    if dtype is not None and dtype != file_dtype:
        raise CheckpointError(f"{path.name} was quantized for {meta['dtype']} activations; run it with --dtype "
                              f"{meta['dtype']} or quantize again with --dtype {str(dtype).removeprefix('torch.')}")
    return handler


def quantized_checkpoint(checkpoint: Path, mode: str, device: str = "cpu") -> Path:
    """The file `python quantize.py --mode MODE [--quantize_lm_head for int4]` writes beside a float
    `checkpoint` (int4: group size 32 with the LM head quantized too, the fastest measured; int8: float
    LM head), made on first use with a one-line status message; later calls reuse it and say so."""
    handler = handler_for(mode)
    out = checkpoint.parent / handler.file_name
    if out.is_file():
        print(f"Using {mode} weights quantized earlier: {out.name}", file=sys.stderr)
        return out
    print(f"Quantizing {checkpoint.name} to {mode} (once) ...", end=" ", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = Transformer.from_checkpoint(checkpoint, device=device, dtype=torch.bfloat16)
    save_quantized(model, quantize_model(model, handler, quantize_lm_head=mode == "int4"), out)
    print(f"{out.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="Weight-only int8 / int4 and w8a8 quantization (torchao) of a model.pth.")
    p.add_argument("--checkpoint_path", type=Path, help="model.pth (default: SmolLM2-135M-Instruct)")
    p.add_argument("--mode", required=True, choices=["int8", "int4", "w8a8"])
    p.add_argument("--groupsize", type=int, choices=[32, 64, 128], help="int4 group size (default 32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: int4 is packed for this device type")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="activation dtype the file runs in (scales, norms, embedding)")
    p.add_argument("--quantize_lm_head", action="store_true", help="quantize the LM head too (a copy when tied)")
    args = p.parse_args(argv)
    if args.checkpoint_path is None:
        from tokenizer import ensure_default_model
        args.checkpoint_path = ensure_default_model()
    if QUANTIZED_NAME.fullmatch(args.checkpoint_path.name):
        raise QuantizeError(f"{args.checkpoint_path} is already quantized; give the float model.pth")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantizeError("--device cuda asked for, but this machine has no CUDA device")
    handler = handler_for(args.mode, args.groupsize)
    model = Transformer.from_checkpoint(args.checkpoint_path, device=args.device, dtype=DTYPES[args.dtype])
    metadata = quantize_model(model, handler, quantize_lm_head=args.quantize_lm_head)
    out = args.checkpoint_path.parent / handler.file_name
    save_quantized(model, metadata, out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB; {args.checkpoint_path.stat().st_size / 2**20:.1f} MiB "
          f"before): {metadata}")


if __name__ == "__main__":
    try:
        main()
    except (QuantizeError, CheckpointError) as e:
        sys.exit(f"error: {e}")
