"""The LLaMA-family decoder (Llama-2/3/3.1, Vicuna, Mistral, SmolLM2, Qwen2) in plain PyTorch.

gpt-fast style: a preallocated static KV cache written at `input_pos`, RoPE precomputed as real
(cos, sin) tables, attention as one `scaled_dot_product_attention` call under a boolean mask. For EAGLE,
`forward` takes any boolean mask over the cache and explicit rotary positions (a draft tree verified in
one call: a node sees the prefix and its ancestors), and returns features beside the logits: the
post-final-norm hidden states (EAGLE's "feature") or, with `feature_layers` set (EAGLE-3), the hidden
states entering those layers, concatenated.

q/k projection rows use the interleaved-pair rotary layout (llama.cpp / gpt-fast / Meta's original):
`scripts/convert_hf_checkpoint.py` permutes HF checkpoints into it; GGUF files store it too
(`save_gguf_checkpoint`). This file imports nothing else of the repository; `load_state` is the one
loader every checkpoint format (model.pth, quantize.py's files, EAGLE heads) goes through.
"""
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not describe a supported model."""


SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "model.pth"


@dataclass
class ModelArgs:
    dim: int = 576
    n_layer: int = 30
    n_head: int = 9
    n_local_heads: int = 3  # key/value heads (grouped-query attention)
    intermediate_size: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3.1 "llama3" scaling
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    head_dim: int = 0  # 0: dim // n_head

    def __post_init__(self):
        self.head_dim = self.head_dim or self.dim // self.n_head

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        """Build from a HF `config.json` dict (LlamaConfig / MistralConfig / Qwen2Config keys)."""
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        rope = config.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta and the scaling here
        scaling = config.get("rope_scaling") or rope or None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default"):
            raise CheckpointError(f"unsupported rope_scaling {scaling}; only 'llama3' scaling is implemented")
        n_head = config["num_attention_heads"]
        return cls(
            dim=config["hidden_size"], n_layer=config["num_hidden_layers"], n_head=n_head,
            n_local_heads=config.get("num_key_value_heads") or n_head,
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5), rope_base=config.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3" else None,
            tie_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", archs[0] == "Qwen2ForCausalLM"),
            head_dim=config.get("head_dim") or config["hidden_size"] // n_head,
        )

    @classmethod
    def from_checkpoint_dir(cls, checkpoint_dir: Path) -> "ModelArgs":
        path = Path(checkpoint_dir) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text()))
        except FileNotFoundError:
            raise CheckpointError(f"{path} not found") from None
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{path} is not a valid model config ({type(e).__name__}: {e})") from None


class KVCache(nn.Module):
    """Preallocated keys and values, [batch, kv_heads, max_seq_len, head_dim], written at `input_pos`."""

    def __init__(self, batch_size, max_seq_len, n_heads, head_dim, dtype):
        super().__init__()
        shape = (batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor):
        """Write k, v [B, kv_heads, T, head_dim] at slots input_pos: [T] for every row, or [B, T] per row."""
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        if input_pos.dim() == 1:
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
        else:  # each row at its own slots (a batch whose sequences have different lengths)
            rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(input_pos)
            self.k_cache[rows, :, input_pos] = k.transpose(1, 2)  # index_put_: [B, T, kv_heads, head_dim]
            self.v_cache[rows, :, input_pos] = v.transpose(1, 2)
        return self.k_cache, self.v_cache

    def move(self, src: Tensor, dst: Tensor):
        """Copy cache slots `src` to slots `dst` (committing an accepted tree path): [T] in every row, or
        [B, T] each row its own."""
        if src.dim() == 1:
            self.k_cache.index_copy_(2, dst, self.k_cache.index_select(2, src))
            self.v_cache.index_copy_(2, dst, self.v_cache.index_select(2, src))
            return
        rows = torch.arange(src.shape[0], device=src.device)[:, None]  # gathers [B, T, kv_heads, head_dim]
        self.k_cache[rows, :, dst] = self.k_cache[rows, :, src]
        self.v_cache[rows, :, dst] = self.v_cache[rows, :, src]


@contextmanager
def narrow_caches(caches: list, row):
    """Within the block these KV caches are batch row `row` alone, or the rows of a slice (views: a batch-1
    forward, such as one sequence's prefill, writes into that row of the full caches)."""
    rows = row if isinstance(row, slice) else slice(row, row + 1)
    full = [(cache.k_cache, cache.v_cache) for cache in caches]
    for cache, (k, v) in zip(caches, full):
        cache.k_cache, cache.v_cache = k[rows], v[rows]
    try:
        yield
    finally:
        for cache, (k, v) in zip(caches, full):
            cache.k_cache, cache.v_cache = k, v


def cache_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Keys, values and attention run in fp32 on CPU: PyTorch's bf16 attention there is several
    times slower than fp32 for a few query rows (and the cache is small)."""
    return torch.float32 if device.type == "cpu" else weight_dtype


# forward(mask=SELF_CAUSAL): each token sees the earlier tokens of the same call only, not the KV cache (a prompt
# prefilled from slot 0, whose keys and values are still written to the cache; training's target pass over whole
# sequences): SDPA's causal kernel skips the masked half that an explicit mask makes it compute
SELF_CAUSAL = "self-causal"


def causal_mask(input_pos: Tensor, max_seq_len: int) -> Tensor:
    """[T, max_seq_len] bool (input_pos [T]; [B, T, max_seq_len] for per-row slots [B, T]): the token in cache
    slot input_pos[i] sees slots 0..input_pos[i]."""
    return torch.arange(max_seq_len, device=input_pos.device) <= input_pos[..., None]


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_seq_len = self.max_batch_size = 0
        self.quantization: Optional[dict] = None  # quantize.py's metadata when the weights are quantized
        # EAGLE-3's fused features: layer boundaries k (the residual stream entering layer k; k = n_layer:
        # the last layer's output, before the final norm) whose hidden states forward returns,
        # concatenated in this order, instead of the post-norm features. None: the post-norm features.
        self.feature_layers: Optional[tuple] = None

    def setup_caches(self, max_batch_size: int, max_seq_len: int, dtype=None):
        """(Re)allocate the KV caches and the rotary tables for `max_seq_len` positions."""
        device, rope_dtype, c = self.output.weight.device, self.tok_embeddings.weight.dtype, self.config
        dtype = dtype or cache_dtype(rope_dtype, device)
        cache = self.layers[0].attention.kv_cache
        if (self.max_seq_len, self.max_batch_size) == (max_seq_len, max_batch_size) and cache is not None and \
                cache.k_cache.dtype == dtype:
            return
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_len, c.n_local_heads, c.head_dim, dtype).to(device)
        cos, sin = precompute_rope(max_seq_len, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=rope_dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=rope_dtype), persistent=False)

    def kv_caches(self):
        return [layer.attention.kv_cache for layer in self.layers]

    def cache_row(self, row: int):
        """Within the block the KV caches are batch row `row` alone (see narrow_caches)."""
        return narrow_caches(self.kv_caches(), row)

    def forward(self, idx: Tensor, input_pos: Tensor, mask: Optional[Tensor] = None,
                rope_pos: Optional[Tensor] = None, logits_at: Optional[Tensor] = None, prenorm: bool = False):
        """Run tokens `idx` [B, T] written to cache slots `input_pos` [T] (or [B, T]: each row its own slots).
        mask: [T, S] (or [B, 1, T, S]) bool, True where a query may attend to a cache slot; attention reads
        slots 0..S-1 only, S <= max_seq_len (default: causal over the whole cache); SELF_CAUSAL: causal over
        this call's tokens, no cache read (the cache, if any, is written: a prompt from slot 0).
        rope_pos: rotary positions shaped like input_pos (default: input_pos; tree nodes differ).
        logits_at: indices into T where logits are wanted (default: all positions).
        Returns (logits [B, T' , vocab], features [B, T, dim]); features are the post-final-norm
        hidden states, the input of the LM head. With `feature_layers` set, features are instead the
        hidden states at those layer boundaries, concatenated [B, T, len(feature_layers) * dim]. prenorm
        (without feature_layers): the final norm's input instead, which the caller normalises itself; a compiled
        graph that returns the norm's output cannot fuse the norm into the LM head's GEMM (int4, one row: 1.3%
        of a step).
        """
        mask = causal_mask(input_pos, self.max_seq_len) if mask is None else mask
        if not isinstance(mask, str):
            mask = mask[:, None] if mask.dim() == 3 else mask  # [B, T, S] -> [B, heads (broadcast), T, S]
        rope_pos = input_pos if rope_pos is None else rope_pos
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]
        x = self.tok_embeddings(idx)
        taps = self.feature_layers
        tapped = {}
        for i, layer in enumerate(self.layers):
            if taps is not None and i in taps:
                tapped[i] = x
            x = layer(x, input_pos, cos, sin, mask)
        features = self.norm(x)
        selected = features if logits_at is None else features[:, logits_at]
        if taps is not None:
            tapped[len(self.layers)] = x
            features = torch.cat([tapped[i] for i in taps], dim=-1)
        elif prenorm:
            features = x
        return self.output(selected), features

    @classmethod
    def from_checkpoint(cls, checkpoint_path, device="cpu", dtype=None) -> "Transformer":
        """Load `model.pth` and the `config.json` beside it, in `dtype` (default float32). quantize.py's
        files (`model_int8.pth`, `model_int4.g<N>.pth`) load with quantize.load_quantized."""
        checkpoint_path = Path(checkpoint_path)
        if not checkpoint_path.is_file():
            raise CheckpointError(f"{checkpoint_path} not found")
        if checkpoint_path.name.startswith("model_int"):
            raise CheckpointError(f"{checkpoint_path} is quantized; load it with quantize.load_quantized")
        config = ModelArgs.from_checkpoint_dir(checkpoint_path.parent)
        try:
            state = torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{checkpoint_path} cannot be read ({type(e).__name__}); convert it again") from None
        return cls.from_state(config, state, checkpoint_path).to(device=device, dtype=dtype or torch.float32).eval()

    @classmethod
    def from_state(cls, config: ModelArgs, state: dict, source, tied: Optional[bool] = None,
                   requires_grad: bool = True) -> "Transformer":
        """A model holding the tensors of `state` (no copies); tied: the LM head shares the embedding's
        matrix (default: as the config says)."""
        tied = config.tie_embeddings if tied is None else tied
        if tied and "tok_embeddings.weight" in state:
            state = {**state, "output.weight": state["tok_embeddings.weight"]}
        model = load_state(lambda: cls(config).requires_grad_(requires_grad), state, source)
        if tied:
            model.output.weight = model.tok_embeddings.weight
        return model

    def state_dict_for_save(self):
        state = self.state_dict()
        if self.config.tie_embeddings:
            state.pop("output.weight")
        return state


def load_state(build, state: dict, source) -> nn.Module:
    """The module `build()` makes, built on the meta device, holding the tensors of `state`; a state that
    does not fit it becomes one line: "<source> does not match its config.json: <torch's first complaint>"."""
    with torch.device("meta"):
        module = build()
    try:
        module.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as e:
        lines = str(e).splitlines()
        raise CheckpointError(f"{source} does not match its config.json: {lines[min(1, len(lines) - 1)].strip()}") from None
    return module


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, input_pos, cos, sin, mask):
        h = x + self.attention(self.attention_norm(x), input_pos, cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, bias: Optional[bool] = None):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=config.attention_bias if bias is None else bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, input_pos, cos, sin, mask):
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, self.n_head, self.head_dim), cos, sin)
        k = apply_rope(k.view(bsz, seqlen, self.n_local_heads, self.head_dim), cos, sin)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        if mask is SELF_CAUSAL:  # in the precision a KV cache would hold them
            q, k, v = (t.to(cache_dtype(x.dtype, x.device)) for t in (q, k, v))
            if self.kv_cache is not None:
                self.kv_cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_head != self.n_local_heads)
            return self.wo(y.to(x.dtype).transpose(1, 2).reshape(bsz, seqlen, q_size))
        if self.kv_cache is not None:  # None when training the EAGLE head on whole sequences
            k, v = self.kv_cache.update(input_pos, k, v)
        y = self.attend(q, k, v, mask)
        return self.wo(y.to(x.dtype).transpose(1, 2).reshape(bsz, seqlen, q_size))

    def attend(self, q, k, v, mask):
        """q [B, heads, T, head_dim] over the first mask.shape[-1] slots of k, v (the slots the mask covers)."""
        S = mask.shape[-1]
        k, v = k[:, :, :S], v[:, :, :S]
        if k.dtype == torch.bfloat16 and k.device.type == "cpu" and mask.dim() == 4:
            return decode_attention(q, k, v, mask)  # a step's few queries per row (4-D masks: the engine's steps)
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                              enable_gqa=self.n_head != self.n_local_heads)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """A few queries per row (q [B, heads, T, head_dim]: a decode step's one, a tree's nodes) over a bf16 cache (k, v
    [B, kv_heads, S, head_dim]), in fp32: the steps of an engine given kv_dtype bf16 (scripts/make_data.py's
    batches). Written as broadcast products and sums
    over each kv head's slots for the query heads sharing it (no per-head copy of the cache), which inductor fuses
    into two vectorised loops; PyTorch's bf16 attention kernel is 6x slower here and its fp32 kernel on an fp32
    cache 1.3x (B=16, S=400, T=1, one thread, AVX-512 BF16). Slow in eager mode: meant for compiled steps."""
    B, H, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, kv_heads, H // kv_heads, T, 1, D).float() * D ** -0.5  # the query heads of each kv head
    scores = (qg * k[:, :, None, None]).sum(-1, dtype=torch.float32)  # [B, kv_heads, H / kv_heads, T, S]
    scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, T, S), float("-inf"))  # mask [B or 1, 1, T, S]
    p = torch.softmax(scores, dim=-1)
    return (p[..., None] * v[:, :, None, None]).sum(-2, dtype=torch.float32).reshape(B, H, T, D)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def precompute_rope(seq_len: int, head_dim: int, base: float, scaling: Optional[dict] = None):
    """cos, sin tables [seq_len, head_dim // 2] in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = llama3_scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def llama3_scale_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama-3.1 rope scaling: long wavelengths slowed by `factor`, a smooth ramp in between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(middle, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, T, heads, head_dim]; cos/sin [T, head_dim//2] (or
    [B, T, head_dim//2]: per-row positions)."""
    xs = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xs[..., 0], xs[..., 1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).type_as(x)


def halves_to_interleaved(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """HF q/k rows (per head: all first halves, then all second halves) -> interleaved pairs."""
    return w.view(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(n_heads * head_dim, -1)


def interleaved_to_halves(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(n_heads * head_dim, -1)


# ---------------------------------------------------------------- GGUF (llama architecture)
GGUF_LAYER_NAMES = {  # GGUF tensor name after "blk.N." -> ours after "layers.N."
    "attn_norm.weight": "attention_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_output.weight": "attention.wo.weight", "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight", "ffn_up.weight": "feed_forward.w3.weight",
}
GGUF_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
              "output.weight": "output.weight"}


def gguf_config(reader) -> dict:
    """A HF-style LlamaConfig dict from the metadata of a `gguf.GGUFReader`."""
    def field(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    if field("general.architecture") != "llama":
        raise CheckpointError(f"GGUF architecture {field('general.architecture')!r} is not supported; "
                              "only 'llama' GGUF files convert")
    n_head = int(field("llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": int(field("llama.embedding_length")),
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": int(field("llama.attention.head_count_kv", n_head)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("llama.context_length")),
        "vocab_size": len(field("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": field("tokenizer.ggml.bos_token_id"), "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }


def gguf_state_dict(reader) -> dict:
    """Our state dict from a GGUF's tensors, dequantized to float32 (gguf's dequantize); q, k and v fuse
    into wqkv. GGUF keeps llama q/k rows interleaved, as we do, so nothing is permuted."""
    import numpy as np
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a writable copy
        if t.name in GGUF_NAMES:
            tensors[GGUF_NAMES[t.name]] = weight
        else:
            _, layer, rest = t.name.split(".", 2)
            tensors[f"layers.{layer}.{GGUF_LAYER_NAMES.get(rest, rest)}"] = weight
    state = {}
    for name, weight in tensors.items():
        if name.endswith("attn_q.weight"):
            prefix = name[: -len("attn_q.weight")]
            state[prefix + "attention.wqkv.weight"] = torch.cat(
                [weight, tensors[prefix + "attn_k.weight"], tensors[prefix + "attn_v.weight"]])
        elif not name.endswith(("attn_k.weight", "attn_v.weight")):
            state[name] = weight
    return state


def save_gguf_checkpoint(reader, out_dir: Path) -> Path:
    """Write config.json and model.pth (atomically: a half-written model.pth never exists) from a GGUF."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(gguf_config(reader), indent=2))
    tmp = out_dir / f"model.pth.tmp{os.getpid()}"
    torch.save(gguf_state_dict(reader), tmp)
    return tmp.rename(out_dir / "model.pth")
