"""The EAGLE-1 draft head ("Autoregression Head") and its official checkpoint format.

At draft position i the head reads the target's feature f_i (post-final-norm hidden state) and the
embedding of the token *after* it, t_{i+1}:  x_i = fc(concat(embed(t_{i+1}), f_i)).
One LLaMA decoder layer without input RMSNorm and without final norm turns x_i into a prediction
of f_{i+1}; the target's LM head maps it to the draft distribution of t_{i+2}.
The target's embedding and LM head are reused (frozen); only `fc` and the layer are trained.

Draft vocabulary (optional, as EAGLE-3 does): a head may draft from only the most frequent tokens
(`draft_vocab.json`, a list of token ids). The draft then multiplies by those rows of the LM head
only, which on a CPU makes a draft step several times cheaper (the 49152-row LM head is most of
it). Verification still uses the full target, so this changes speed and acceptance, never output.

Input representation (`input_mode`, for the paper's ablation only; the shipped head is "shifted"):
"shifted" is EAGLE's fc(concat(embed(t_{i+1}), f_i)); "unshifted" pairs f_i with its own token t_i, so the
draft never sees the token sampled after f_i; "feature" and "token" zero the other half of the input.
Callers pick the token with `pair_tokens`; everything else is the same for every mode.

Checkpoints use the layout of the public heads (yuhuili/EAGLE-*), which SGLang and vLLM also read:
config.json (LlamaConfig keys + "bias") and pytorch_model.bin or model.safetensors with keys
fc.weight, fc.bias (optional), layers.0.self_attn.{q,k,v,o}_proj.weight,
layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight
(embed_tokens.weight, when present, is ignored). q/k rows there are in HF's half-split rotary
layout; they are permuted to model.py's interleaved-pair layout on load and back on save.
"""
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import (Attention, CheckpointError, FeedForward, KVCache, ModelArgs, RMSNorm, cache_dtype,
                   causal_mask, halves_to_interleaved, interleaved_to_halves, load_state, precompute_rope)


INPUT_MODES = ("shifted", "unshifted", "feature", "token")


class EagleHead(nn.Module):
    def __init__(self, config: ModelArgs, fc_bias: bool = True, input_mode: str = "shifted"):
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {', '.join(INPUT_MODES)}, got {input_mode!r}")
        self.config = config
        self.fc_bias = fc_bias
        self.input_mode = input_mode
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=fc_bias)
        self.attention = Attention(config, bias=False)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.max_seq_len = 0
        self.draft_vocab: Optional[Tensor] = None  # token ids the draft may propose (None: all)
        self.lm_weight: Optional[Tensor] = None  # the target's LM head rows for draft_vocab (bind)
        self.quantized_with = None  # a quantize.py handler: bind() quantizes lm_weight with it too

    @classmethod
    def for_target(cls, target_config: ModelArgs, fc_bias: bool = True, input_mode: str = "shifted") -> "EagleHead":
        """A fresh head shaped for a target: one layer of the target's dimensions and rope_theta."""
        config = ModelArgs(**{**asdict(target_config), "n_layer": 1, "attention_bias": False, "rope_scaling": None})
        return cls(config, fc_bias, input_mode)

    def setup_caches(self, max_seq_len: int, dtype=None):
        if self.max_seq_len == max_seq_len and self.attention.kv_cache is not None:
            return
        weight = self.fc.weight
        c = self.config
        dtype = dtype or cache_dtype(weight.dtype, weight.device)
        self.attention.kv_cache = KVCache(1, max_seq_len, c.n_local_heads, c.head_dim, dtype).to(weight.device)
        self.setup_rope(max_seq_len)

    def setup_rope(self, max_seq_len: int, dtype=None):
        """Rotary tables only: training runs whole sequences with no KV cache."""
        dtype = dtype or self.fc.weight.dtype
        device = self.fc.weight.device
        c = self.config
        self.max_seq_len = max_seq_len
        cos, sin = precompute_rope(max_seq_len, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, token_embeds: Tensor, features: Tensor, input_pos: Tensor,
                mask: Optional[Tensor] = None, rope_pos: Optional[Tensor] = None) -> Tensor:
        """token_embeds: [B, T, dim] embeddings of t_{i+1} (of `pair_tokens`); features: [B, T, dim]
        the features f_i (true or predicted) at the same positions. Returns the predicted f_{i+1}."""
        if self.input_mode == "feature":
            token_embeds = torch.zeros_like(token_embeds)
        elif self.input_mode == "token":
            features = torch.zeros_like(features)
        if mask is None:
            mask = causal_mask(input_pos, self.max_seq_len)
        if rope_pos is None:
            rope_pos = input_pos
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        h = x + self.attention(x, input_pos, self.rope_cos[rope_pos], self.rope_sin[rope_pos], mask)
        return h + self.feed_forward(self.post_attention_norm(h))

    def pair_tokens(self, next_tokens: Tensor, own_tokens: Tensor) -> Tensor:
        """The tokens whose embeddings go with features f_i: t_{i+1} (EAGLE), or t_i ("unshifted")."""
        return own_tokens if self.input_mode == "unshifted" else next_tokens

    def bind(self, target_lm_weight: Tensor):
        """Keep the target LM head rows of the draft vocabulary (a copy when it is a subset)."""
        weight = target_lm_weight
        if type(weight) not in (torch.Tensor, nn.Parameter):  # a quantized tensor subclass
            from quantize import dequantized  # torchao's int4 tensors have no dequantize()
            weight = dequantized(weight)
        weight = weight.to(self.fc.weight.dtype)
        if self.draft_vocab is None:
            self.lm_weight = weight.detach()
        else:
            self.draft_vocab = self.draft_vocab.to(weight.device)
            self.lm_weight = weight.detach()[self.draft_vocab].contiguous()
        if self.quantized_with is not None:
            from quantize import QuantizeError, quantized_weight
            try:
                self.lm_weight = quantized_weight(self.lm_weight, self.quantized_with)
            except QuantizeError:  # a draft vocabulary the int4 kernel cannot take stays in float
                pass

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary; `token_ids` maps their indices to token ids."""
        return F.linear(hidden, self.lm_weight)

    def token_ids(self, index: Tensor) -> Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def check_fits(self, target_config: ModelArgs, vocab_size: int):
        if self.config.dim != target_config.dim:
            raise CheckpointError(f"EAGLE head hidden size {self.config.dim} does not fit the target's "
                                  f"hidden size {target_config.dim}; use a head trained for this model")
        if self.config.vocab_size != vocab_size:
            raise CheckpointError(f"EAGLE head vocabulary {self.config.vocab_size} does not fit the target's "
                                  f"vocabulary {vocab_size}; use a head trained for this model")

    # ---- official checkpoint layout ----
    def save(self, out_dir, target_embedding: Optional[Tensor] = None, safetensors: bool = False):
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        c = self.config
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": self.fc_bias,
            "hidden_size": c.dim, "intermediate_size": c.intermediate_size, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_local_heads, "num_hidden_layers": 1, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_base, "vocab_size": c.vocab_size, "hidden_act": "silu", "torch_dtype": "float32",
            "head_dim": c.head_dim,
        }
        if self.input_mode != "shifted":  # an ablation head; EAGLE's own layout has no such key
            config["eagle_input_mode"] = self.input_mode
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.float().contiguous() for k, v in self.official_state_dict().items()}
        if target_embedding is not None:
            state["embed_tokens.weight"] = target_embedding.float().contiguous()
        if self.draft_vocab is not None:
            (out_dir / "draft_vocab.json").write_text(json.dumps(self.draft_vocab.tolist()))
        if safetensors:
            from safetensors.torch import save_file
            save_file(state, out_dir / "model.safetensors")
        else:
            torch.save(state, out_dir / "pytorch_model.bin")

    def official_state_dict(self) -> dict:
        c, a = self.config, self.attention
        q, k, v = a.wqkv.weight.detach().split([c.n_head * c.head_dim, c.n_local_heads * c.head_dim,
                                                c.n_local_heads * c.head_dim])
        state = {
            "fc.weight": self.fc.weight,
            "layers.0.self_attn.q_proj.weight": interleaved_to_halves(q, c.n_head, c.head_dim),
            "layers.0.self_attn.k_proj.weight": interleaved_to_halves(k, c.n_local_heads, c.head_dim),
            "layers.0.self_attn.v_proj.weight": v,
            "layers.0.self_attn.o_proj.weight": a.wo.weight,
            "layers.0.post_attention_layernorm.weight": self.post_attention_norm.weight,
            "layers.0.mlp.gate_proj.weight": self.feed_forward.w1.weight,
            "layers.0.mlp.up_proj.weight": self.feed_forward.w3.weight,
            "layers.0.mlp.down_proj.weight": self.feed_forward.w2.weight,
        }
        if self.fc_bias:
            state["fc.bias"] = self.fc.bias
        return {k: t.detach() for k, t in state.items()}

    @classmethod
    def load(cls, head_dir, device="cpu", dtype=torch.float32) -> "EagleHead":
        head_dir = Path(head_dir)
        config_path = head_dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"no EAGLE head at {head_dir} (config.json missing); "
                                  "train one with scripts/train_eagle.py or fetch one with scripts/download.py")
        try:
            config_dict = json.loads(config_path.read_text())
            config = ModelArgs.from_config({**config_dict, "architectures": ["LlamaForCausalLM"]})
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{config_path} is not a valid EAGLE head config ({e})") from None
        config.n_layer, config.attention_bias, config.tie_embeddings = 1, False, False
        state = read_weights(head_dir)
        c = config
        try:
            wqkv = torch.cat([
                halves_to_interleaved(state["layers.0.self_attn.q_proj.weight"], c.n_head, c.head_dim),
                halves_to_interleaved(state["layers.0.self_attn.k_proj.weight"], c.n_local_heads, c.head_dim),
                state["layers.0.self_attn.v_proj.weight"]])
            ours = {
                "fc.weight": state["fc.weight"], "attention.wqkv.weight": wqkv,
                "attention.wo.weight": state["layers.0.self_attn.o_proj.weight"],
                "post_attention_norm.weight": state["layers.0.post_attention_layernorm.weight"],
                "feed_forward.w1.weight": state["layers.0.mlp.gate_proj.weight"],
                "feed_forward.w3.weight": state["layers.0.mlp.up_proj.weight"],
                "feed_forward.w2.weight": state["layers.0.mlp.down_proj.weight"],
            }
        except KeyError as e:
            raise CheckpointError(f"EAGLE head in {head_dir} lacks weight {e.args[0]}; is it an EAGLE-1/2 head?") from None
        fc_bias = "fc.bias" in state
        if fc_bias:
            ours["fc.bias"] = state["fc.bias"]
        input_mode = config_dict.get("eagle_input_mode", "shifted")
        if input_mode not in INPUT_MODES:
            raise CheckpointError(f"{config_path}: eagle_input_mode {input_mode!r} is not one of {', '.join(INPUT_MODES)}")
        head = load_state(lambda: cls(config, fc_bias, input_mode), ours, f"EAGLE head in {head_dir}")
        if (head_dir / "draft_vocab.json").is_file():
            head.draft_vocab = torch.tensor(json.loads((head_dir / "draft_vocab.json").read_text()))
            if head.draft_vocab.numel() == 0 or int(head.draft_vocab.max()) >= config.vocab_size:
                raise CheckpointError(f"{head_dir / 'draft_vocab.json'} holds token ids outside the vocabulary")
        return head.to(device=device, dtype=dtype).eval()


def read_weights(head_dir: Path) -> dict:
    try:
        if (head_dir / "model.safetensors").is_file():
            from safetensors.torch import load_file
            return load_file(head_dir / "model.safetensors")
        if (head_dir / "pytorch_model.bin").is_file():
            return torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"EAGLE head weights in {head_dir} cannot be read ({type(e).__name__}); "
                              "download or train it again") from None
    raise CheckpointError(f"no pytorch_model.bin or model.safetensors in {head_dir}")

