"""The EAGLE draft heads and their official checkpoint formats: EagleHead (EAGLE-1, "Autoregression Head",
below) and Eagle3Head (EAGLE-3, further down), both DraftHeads.

EAGLE-1: at draft position i the head reads the target's feature f_i (post-final-norm hidden state) and the
embedding of the token *after* it, t_{i+1}: x_i = fc(concat(embed(t_{i+1}), f_i)). One LLaMA decoder
layer without input RMSNorm and final norm turns x_i into a prediction of f_{i+1}; the target's LM head
(reused and frozen, as its embedding) maps it to the draft distribution of t_{i+2}.

Draft vocabulary (optional, as EAGLE-3 does): a head may draft from only the most frequent tokens
(`draft_vocab.json`, a list of token ids), multiplying by those rows of the LM head only: on a CPU a
draft step several times cheaper. Verification uses the full target: speed and acceptance change, never output.

Input representation (`input_mode`, for the paper's ablation only; the shipped head is "shifted"): "unshifted"
pairs f_i with its own token t_i (callers pick the token with `pair_tokens`); "feature" and "token" zero
the other half of the input.

Checkpoints use the layout of the public heads (yuhuili/EAGLE-*), which SGLang and vLLM also read:
config.json (LlamaConfig keys + "bias") and pytorch_model.bin or model.safetensors with keys fc.weight,
fc.bias (optional), layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.post_attention_layernorm.weight,
layers.0.mlp.{gate,up,down}_proj.weight (embed_tokens.weight, when present, is ignored); a head with
num_hidden_layers N > 1 (not the shape EAGLE ships; `train_eagle.py online --head_layers`) adds layers.1 ..
layers.N-1, each with its input_layernorm too. q/k rows are in HF's half-split rotary layout, permuted to
model.py's interleaved pairs on load and back on save.
"""
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from model import (Attention, CheckpointError, FeedForward, KVCache, ModelArgs, RMSNorm, TransformerBlock,
                   cache_dtype, causal_mask, halves_to_interleaved, interleaved_to_halves, load_state, precompute_rope)


INPUT_MODES = ("shifted", "unshifted", "feature", "token")


class DraftHead(nn.Module):
    """What both head kinds (EagleHead, Eagle3Head) share: their attention layers' KV caches and rotary tables
    (set up from self.fc, self.config and self.attentions()), the calls the engine and training make on either."""

    def attentions(self) -> list:
        raise NotImplementedError

    def kv_caches(self) -> list:
        return [a.kv_cache for a in self.attentions()]

    def set_kv_caches(self, make: Callable[[], Optional[nn.Module]]):
        """Give every layer's attention a cache of its own from make() (None: no cache, whole-sequence training)."""
        for a in self.attentions():
            a.kv_cache = make()

    def clear_kv_caches(self):
        """No cache in any layer: whole-sequence training and evaluation (setup_caches makes them again)."""
        self.set_kv_caches(lambda: None)

    def setup_caches(self, max_seq_len: int, dtype=None, batch_size: int = 1):
        cache = self.attention.kv_cache
        if self.max_seq_len == max_seq_len and cache is not None and cache.k_cache.shape[0] == batch_size:
            return
        weight, c = self.fc.weight, self.config
        dtype = dtype or cache_dtype(weight.dtype, weight.device)
        self.set_kv_caches(lambda: KVCache(batch_size, max_seq_len, c.n_local_heads, c.head_dim, dtype).to(weight.device))
        self.setup_rope(max_seq_len)

    def setup_rope(self, max_seq_len: int, dtype=None):
        """Rotary tables only: training runs whole sequences with no KV cache."""
        dtype, device, c = dtype or self.fc.weight.dtype, self.fc.weight.device, self.config
        self.max_seq_len = max_seq_len
        cos, sin = precompute_rope(max_seq_len, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)


class EagleHead(DraftHead):
    """The EAGLE-1 head: one decoder layer over fc(concat(embed(t_{i+1}), f_i)), the target's LM head (see above)."""
    feature_layers = None  # reads the target's last feature (after its final norm), as Transformer returns by default

    def __init__(self, config: ModelArgs, fc_bias: bool = True, input_mode: str = "shifted"):
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {', '.join(INPUT_MODES)}, got {input_mode!r}")
        self.config, self.fc_bias, self.input_mode = config, fc_bias, input_mode
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=fc_bias)
        self.attention = Attention(config, bias=False)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        # layers after the first (config.n_layer > 1): whole LLaMA blocks, input norm included, as EAGLE's own code
        # builds them from num_hidden_layers; the shipped heads have none
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer - 1))
        self.max_seq_len = 0
        self.draft_vocab: Optional[Tensor] = None  # token ids the draft may propose (None: all)
        self.__dict__["lm_head"] = None  # bind(): the target's LM head rows for draft_vocab (no submodule)

    @classmethod
    def for_target(cls, target_config: ModelArgs, fc_bias: bool = True, input_mode: str = "shifted",
                   n_layer: int = 1) -> "EagleHead":
        """A fresh head shaped for a target: n_layer layers (EAGLE: one) of the target's dimensions and rope_theta."""
        config = ModelArgs(**{**asdict(target_config), "n_layer": n_layer, "attention_bias": False, "rope_scaling": None})
        return cls(config, fc_bias, input_mode)

    @torch.no_grad()
    def deepened(self, n_layer: int) -> "EagleHead":
        """This head with layers added up to n_layer, each starting as the identity (its attention output and
        MLP down projections zero), so that it drafts exactly as before until trained."""
        config = ModelArgs(**{**asdict(self.config), "n_layer": n_layer})
        head = type(self)(config, self.fc_bias, self.input_mode).to(self.fc.weight)
        head.load_state_dict(self.state_dict(), strict=False)
        for block in head.layers[len(self.layers):]:
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        head.draft_vocab = self.draft_vocab
        return head

    def attentions(self) -> list:
        return [self.attention] + [block.attention for block in self.layers]

    def forward(self, token_embeds: Tensor, features: Tensor, input_pos: Tensor,
                mask: Optional[Tensor] = None, rope_pos: Optional[Tensor] = None) -> Tensor:
        """token_embeds: [B, T, dim] embeddings of t_{i+1} (of `pair_tokens`); features: [B, T, dim]
        the features f_i (true or predicted) at the same positions. Returns the predicted f_{i+1}."""
        if self.input_mode == "feature":
            token_embeds = torch.zeros_like(token_embeds)
        elif self.input_mode == "token":
            features = torch.zeros_like(features)
        mask = causal_mask(input_pos, self.max_seq_len) if mask is None else mask
        rope_pos = input_pos if rope_pos is None else rope_pos
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        h = x + self.attention(x, input_pos, cos, sin, mask)
        h = h + self.feed_forward(self.post_attention_norm(h))
        for block in self.layers:
            h = block(h, input_pos, cos, sin, mask)
        return h

    def pair_tokens(self, next_tokens: Tensor, own_tokens: Tensor) -> Tensor:
        """The tokens whose embeddings go with features f_i: t_{i+1} (EAGLE), or t_i ("unshifted")."""
        return own_tokens if self.input_mode == "unshifted" else next_tokens

    def bind(self, target_lm_weight: Tensor):
        """Draft through the target's LM head: `lm_head` becomes a linear over its rows of the draft
        vocabulary (a copy when that is a subset), no submodule (the target's weights: state dicts,
        optimizers and .to() leave it out). A plain weight only: quantize.quantize_head_like binds a
        quantized target's; a Session binds a head that is not bound yet."""
        if type(target_lm_weight) not in (Tensor, nn.Parameter):
            raise TypeError("EagleHead.bind takes a plain float weight; bind a quantized target's LM head "
                            "with quantize.quantize_head_like")
        weight = target_lm_weight.detach().to(self.fc.weight.dtype)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(weight.device)
            weight = weight[self.draft_vocab].contiguous()
        lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        lm_head.weight = nn.Parameter(weight, requires_grad=False)
        self.__dict__["lm_head"] = lm_head

    @property
    def feature_dim(self) -> int:
        """Width of the target features the head reads (Eagle3Head: its fused layers')."""
        return self.config.dim

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary; `token_ids` maps their indices to token ids."""
        return self.lm_head(hidden)

    def token_ids(self, index: Tensor) -> Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def check_fits(self, target_config: ModelArgs, vocab_size: int):
        check_sizes("EAGLE", self.config, target_config, vocab_size)

    # ---- official checkpoint layout ----
    def save(self, out_dir, target_embedding: Optional[Tensor] = None, safetensors: bool = False):
        config = head_config(self.config, "LlamaForCausalLM", bias=self.fc_bias)
        if self.input_mode != "shifted":  # an ablation head; EAGLE's own layout has no such key
            config["eagle_input_mode"] = self.input_mode
        state = {k: v.float().contiguous() for k, v in self.official_state_dict().items()}
        if target_embedding is not None:
            state["embed_tokens.weight"] = target_embedding.float().contiguous()
        write_head(out_dir, config, state, safetensors)
        if self.draft_vocab is not None:
            (Path(out_dir) / "draft_vocab.json").write_text(json.dumps(self.draft_vocab.tolist()))

    def official_state_dict(self) -> dict:
        state = {"fc.weight": self.fc.weight, **decoder_layer_state(self, "layers.0.", self.config)}
        for i, block in enumerate(self.layers, 1):
            state.update(decoder_layer_state(block, f"layers.{i}.", self.config))
        if self.fc_bias:
            state["fc.bias"] = self.fc.bias
        return {k: t.detach() for k, t in state.items()}

    @classmethod
    def load(cls, head_dir, device="cpu", dtype=torch.float32) -> "EagleHead":
        head_dir = Path(head_dir)
        config_path, config_dict = head_dir / "config.json", read_head_config(head_dir)
        try:
            config = ModelArgs.from_config({**config_dict, "architectures": ["LlamaForCausalLM"]})
        except KeyError as e:
            raise CheckpointError(f"{config_path} is not a valid EAGLE head config ({e})") from None
        config.attention_bias, config.tie_embeddings = False, False
        config.n_layer = int(config_dict.get("num_hidden_layers", 1))
        state = read_weights(head_dir)
        try:
            ours = {"fc.weight": state["fc.weight"], **decoder_layer_from_state(state, "layers.0.", config)}
            for i in range(1, config.n_layer):
                ours.update({f"layers.{i - 1}.{k}": v
                             for k, v in decoder_layer_from_state(state, f"layers.{i}.", config, block=True).items()})
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


def check_sizes(kind: str, config: ModelArgs, target_config: ModelArgs, vocab_size: int):
    """Refuse a head whose hidden size or vocabulary is not the target's, in one line."""
    for what, mine, theirs in (("hidden size", config.dim, target_config.dim), ("vocabulary", config.vocab_size, vocab_size)):
        if mine != theirs:
            raise CheckpointError(f"{kind} head {what} {mine} does not fit the target's {what} {theirs}; "
                                  "use a head trained for this model")


def layer_parts(layer: nn.Module) -> dict:
    """Our modules of a decoder layer by HF LLaMA name: the head's own first layer (no input norm) or a
    TransformerBlock (a layer after it)."""
    if isinstance(layer, TransformerBlock):
        return {"self_attn": layer.attention, "post_attention_layernorm": layer.ffn_norm, "mlp": layer.feed_forward,
                "input_layernorm": layer.attention_norm}
    return {"self_attn": layer.attention, "post_attention_layernorm": layer.post_attention_norm, "mlp": layer.feed_forward}


def decoder_layer_state(layer: nn.Module, prefix: str, c: ModelArgs) -> dict:
    """A decoder layer's weights under HF LLaMA names after `prefix`, q/k rows back in HF's rotate-half layout."""
    parts = layer_parts(layer)
    a, mlp = parts["self_attn"], parts["mlp"]
    q, k, v = a.wqkv.weight.detach().split([c.n_head * c.head_dim, c.n_local_heads * c.head_dim,
                                            c.n_local_heads * c.head_dim])
    names = {"self_attn.q_proj": interleaved_to_halves(q, c.n_head, c.head_dim),
             "self_attn.k_proj": interleaved_to_halves(k, c.n_local_heads, c.head_dim),
             "self_attn.v_proj": v, "self_attn.o_proj": a.wo.weight,
             "post_attention_layernorm": parts["post_attention_layernorm"].weight, "mlp.gate_proj": mlp.w1.weight,
             "mlp.up_proj": mlp.w3.weight, "mlp.down_proj": mlp.w2.weight}
    if "input_layernorm" in parts:
        names["input_layernorm"] = parts["input_layernorm"].weight
    return {f"{prefix}{name}.weight": weight for name, weight in names.items()}


def decoder_layer_from_state(state: dict, prefix: str, c: ModelArgs, block: bool = False) -> dict:
    """decoder_layer_state's inverse: our names for the layer's weights in `state` (KeyError if one is missing),
    those of the head's first layer, or (block) of a TransformerBlock."""
    wqkv = torch.cat([halves_to_interleaved(state[f"{prefix}self_attn.q_proj.weight"], c.n_head, c.head_dim),
                      halves_to_interleaved(state[f"{prefix}self_attn.k_proj.weight"], c.n_local_heads, c.head_dim),
                      state[f"{prefix}self_attn.v_proj.weight"]])
    names = {"attention.wo": "self_attn.o_proj", "post_attention_norm": "post_attention_layernorm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    if block:
        names = {**{k: v for k, v in names.items() if k != "post_attention_norm"},
                 "ffn_norm": "post_attention_layernorm", "attention_norm": "input_layernorm"}
    return {"attention.wqkv.weight": wqkv, **{f"{ours}.weight": state[f"{prefix}{theirs}.weight"]
                                             for ours, theirs in names.items()}}


def head_config(c: ModelArgs, architecture: str, **keys) -> dict:
    """The config.json of a head of config c (LlamaConfig keys), and `keys`."""
    return {"architectures": [architecture], "model_type": "llama", "hidden_size": c.dim,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_local_heads, "num_hidden_layers": c.n_layer, "rms_norm_eps": c.norm_eps,
            "rope_theta": c.rope_base, "vocab_size": c.vocab_size, "hidden_act": "silu", "torch_dtype": "float32",
            "head_dim": c.head_dim, **keys}


def write_head(out_dir, config: dict, state: dict, safetensors: bool):
    """config.json and the weights: model.safetensors or pytorch_model.bin, the two files read_weights reads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if safetensors:
        from safetensors.torch import save_file
        save_file(state, out_dir / "model.safetensors")
    else:
        torch.save(state, out_dir / "pytorch_model.bin")


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


# ---------------------------------------------------------------- EAGLE-3
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # EAGLE's and SGLang's, vLLM's


def default_feature_layers(n_layer: int) -> tuple:
    """EAGLE-3's low, middle and high layer boundaries of an n_layer target: the hidden states entering
    layers 2, n_layer // 2 and n_layer - 3 (what the reference, SGLang and vLLM capture by default)."""
    return (2, n_layer // 2, n_layer - 3)


class Eagle3Head(DraftHead):
    """The EAGLE-3 draft head (arXiv 2503.01840), with EagleHead's interface, so generation drives either.

    Differences from EagleHead, all behind the same calls:
    - `features` is the target's fused hidden states [B, T, feature_dim = len(feature_layers) * dim]
      (the residual stream entering the layers `feature_layers`, as model.Transformer returns them when
      its `feature_layers` is set to this head's) after a target forward (the prompt, a commit), but the
      head's own output hidden [B, T, dim] at a draft step; forward tells them apart by width and maps
      only the fused ones through `fc` (feature_dim -> dim, no bias).
    - The decoder layer's attention reads concat(input_norm(embed(t_{i+1})), hidden_norm(h)), 2 * dim
      wide; the residual is h itself (hidden_norm(h) for heads whose config sets norm_before_residual);
      then post_attention_norm + MLP. forward returns the layer's output before the final `norm`: what
      the next draft step is fed.
    - Its own final `norm` and `lm_head` over a reduced draft vocabulary: draft index i is token id
      i + d2t[i] (d2t None: the whole vocabulary). `bind` takes nothing from the target; the token
      embedding is still the target's.
    - `feature_layers` None (a checkpoint that names no layers) means the target's default boundaries;
      `check_fits` settles them.
    - It is trained on the target distribution only (no feature regression), unrolled over its own
      outputs (training-time test, scripts/train_eagle.py).

    Checkpoints use the official EAGLE-3 layout (yuhuili/EAGLE3-*, which SGLang and vLLM read):
    config.json with architectures ["LlamaForCausalLMEagle3"] and draft_vocab_size; weights fc.weight,
    midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight, norm.weight, lm_head.weight,
    d2t (int64 offsets) and t2d (bool over the target vocabulary), both absent for a full draft
    vocabulary; no embed_tokens. q/k rows are HF's half-split rotary layout, permuted on load and save
    as for EagleHead.
    """

    input_mode = "shifted"  # EAGLE's pairing (f_i with t_{i+1}); the ablation modes are EagleHead's only

    def __init__(self, config: ModelArgs, feature_layers: Optional[tuple] = None,
                 draft_vocab: Optional[Tensor] = None, norm_before_residual: bool = False):
        super().__init__()
        self.config = config
        self.feature_layers = None if feature_layers is None else checked_layers(feature_layers)
        self.norm_before_residual = norm_before_residual
        dim = config.dim
        n_fused = 3 if feature_layers is None else len(self.feature_layers)
        self.fc = nn.Linear(n_fused * dim, dim, bias=False)
        self.input_norm = RMSNorm(dim, config.norm_eps)
        self.hidden_norm = RMSNorm(dim, config.norm_eps)
        self.attention = Attention(config, bias=False)
        self.attention.wqkv = nn.Linear(2 * dim, self.attention.wqkv.out_features, bias=False)
        self.post_attention_norm = RMSNorm(dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.norm = RMSNorm(dim, config.norm_eps)
        n_draft = config.vocab_size if draft_vocab is None else len(draft_vocab)
        self.lm_head = nn.Linear(dim, n_draft, bias=False)
        ids = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
        d2t = None if ids is None else ids - torch.arange(n_draft, device=ids.device)
        self.register_buffer("d2t", d2t)  # [draft vocab] int64 offsets; None: the whole vocabulary
        self.max_seq_len = 0

    @classmethod
    def for_target(cls, target_config: ModelArgs, draft_vocab: Optional[Tensor] = None,
                   feature_layers: Optional[tuple] = None) -> "Eagle3Head":
        """A fresh head for a target: one layer of its dimensions and rope_theta, reading the default
        layer boundaries unless told otherwise; draft_vocab: token ids (None: all)."""
        config = ModelArgs(**{**asdict(target_config), "n_layer": 1, "attention_bias": False, "rope_scaling": None,
                              "tie_embeddings": False})
        return cls(config, feature_layers or default_feature_layers(target_config.n_layer), draft_vocab)

    def attentions(self) -> list:
        return [self.attention]

    @property
    def feature_dim(self) -> int:
        """Width of the target features this head reads (what a caller's feature buffer holds)."""
        return self.fc.in_features

    @property
    def draft_vocab(self) -> Optional[Tensor]:
        """The token ids of the draft vocabulary in draft-index order (None: all tokens)."""
        return None if self.d2t is None else self.token_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))

    def forward(self, token_embeds: Tensor, features: Tensor, input_pos: Tensor,
                mask: Optional[Tensor] = None, rope_pos: Optional[Tensor] = None) -> Tensor:
        """token_embeds [B, T, dim]: embeddings of t_{i+1} (the target's embedding); features: the target's
        fused hidden states at position i [B, T, feature_dim], or the head's own output for the position
        before [B, T, dim] (a draft step). Returns the output hidden [B, T, dim], before the final norm."""
        if features.shape[-1] != self.config.dim:
            features = self.fc(features)
        mask = causal_mask(input_pos, self.max_seq_len) if mask is None else mask
        rope_pos = input_pos if rope_pos is None else rope_pos
        hidden = self.hidden_norm(features)
        x = torch.cat([self.input_norm(token_embeds), hidden], dim=-1)
        residual = hidden if self.norm_before_residual else features
        h = residual + self.attention(x, input_pos, self.rope_cos[rope_pos], self.rope_sin[rope_pos], mask)
        return h + self.feed_forward(self.post_attention_norm(h))

    def pair_tokens(self, next_tokens, own_tokens):
        """EAGLE's shifted pairing: feature f_i goes with t_{i+1}."""
        return next_tokens

    def bind(self, target_lm_weight: Tensor):
        """Nothing to take from the target: the head has its own LM head (EagleHead's interface)."""

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary [..., draft vocab]; `token_ids` maps their indices to token ids."""
        return self.lm_head(self.norm(hidden))

    def token_ids(self, index: Tensor) -> Tensor:
        """Token ids of draft indices: index + d2t[index]."""
        return index if self.d2t is None else index + self.d2t[index]

    def check_fits(self, target_config: ModelArgs, vocab_size: int):
        """Refuse a head made for another target; a head that names no layers takes the target's defaults."""
        check_sizes("EAGLE-3", self.config, target_config, vocab_size)
        layers = self.feature_layers or default_feature_layers(target_config.n_layer)
        if len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) > target_config.n_layer:
            raise CheckpointError(f"EAGLE-3 head reads layers {list(layers)}, which a {target_config.n_layer}-layer "
                                  "target does not have; use a head trained for this model")
        if len(layers) * target_config.dim != self.fc.in_features:
            raise CheckpointError(f"EAGLE-3 head fuses {self.fc.in_features // target_config.dim} layers, not the "
                                  f"{len(layers)} it names; its checkpoint is inconsistent")
        self.feature_layers = checked_layers(layers)

    # ---- official EAGLE-3 checkpoint layout ----
    def save(self, out_dir, safetensors: bool = False):
        c = self.config
        config = head_config(c, EAGLE3_ARCHITECTURES[0], draft_vocab_size=self.lm_head.out_features,
                             tie_word_embeddings=False)
        if c.rope_scaling is not None:
            config["rope_scaling"] = c.rope_scaling
        if self.norm_before_residual:
            config["norm_before_residual"] = True
        if self.feature_layers is not None:
            config.update(layer_ids_config(self.feature_layers))
        write_head(out_dir, config, {k: v.contiguous() for k, v in self.official_state_dict().items()}, safetensors)

    def official_state_dict(self) -> dict:
        c = self.config
        state = {
            "fc.weight": self.fc.weight, **decoder_layer_state(self, "midlayer.", c),
            "midlayer.hidden_norm.weight": self.hidden_norm.weight,
            "midlayer.input_layernorm.weight": self.input_norm.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
        }
        state = {name: t.detach().float().cpu() for name, t in state.items()}
        if self.d2t is not None:
            state["d2t"] = self.d2t.detach().cpu()
            state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, self.draft_vocab.cpu(), True)
        return state

    @classmethod
    def load(cls, head_dir, device="cpu", dtype=torch.float32) -> "Eagle3Head":
        head_dir = Path(head_dir)
        config_dict = read_head_config(head_dir)
        try:
            config = ModelArgs.from_config({**config_dict, "architectures": ["LlamaForCausalLM"]})
            n_draft = int(config_dict.get("draft_vocab_size") or config.vocab_size)
            feature_layers = layer_ids_from_config(config_dict)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{head_dir / 'config.json'} is not a valid EAGLE-3 head config ({e})") from None
        config.n_layer, config.attention_bias, config.tie_embeddings = 1, False, False
        target_dim = config_dict.get("target_hidden_size") or config.dim
        if target_dim != config.dim:
            raise CheckpointError(f"EAGLE-3 head in {head_dir} is {config.dim} wide for a {target_dim}-wide target "
                                  "(target_hidden_size); only heads as wide as their target are supported")
        for key in ("norm_before_fc", "fc_norm"):
            if config_dict.get(key):
                raise CheckpointError(f"EAGLE-3 head in {head_dir} sets {key}, which is not supported")
        state = read_weights(head_dir)
        try:
            ours = {
                "fc.weight": state["fc.weight"], **decoder_layer_from_state(state, "midlayer.", config),
                "hidden_norm.weight": state["midlayer.hidden_norm.weight"],
                "input_norm.weight": state["midlayer.input_layernorm.weight"],
                "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"],
            }
        except KeyError as e:
            raise CheckpointError(f"EAGLE-3 head in {head_dir} lacks weight {e.args[0]}; is it an EAGLE-3 head?") from None
        except RuntimeError as e:  # q/k rows the config's heads cannot split
            raise CheckpointError(f"EAGLE-3 head in {head_dir} does not match its config.json ({e})") from None
        draft_vocab = draft_vocab_from_offsets(state, n_draft, config.vocab_size, head_dir)
        if feature_layers is None and state["fc.weight"].shape[-1] != 3 * config.dim:
            raise CheckpointError(f"EAGLE-3 head in {head_dir} fuses {state['fc.weight'].shape[-1] // config.dim} "
                                  "layers but its config.json names none (eagle_aux_hidden_state_layer_ids)")
        if draft_vocab is not None:
            ours["d2t"] = state["d2t"].long()
        head = load_state(lambda: cls(config, feature_layers, draft_vocab, bool(config_dict.get("norm_before_residual"))),
                          ours, f"EAGLE-3 head in {head_dir}")
        return head.to(device=device, dtype=dtype).eval()


def checked_layers(layers) -> tuple:
    """Layer boundaries in increasing order: the order SGLang and vLLM concatenate them in."""
    layers = tuple(sorted(int(k) for k in layers))
    if len(layers) < 2 or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"EAGLE-3 feature layers must be two or more distinct layer boundaries >= 0, got {list(layers)}")
    return layers


def layer_ids_config(layers: tuple) -> dict:
    """config.json keys naming the layer boundaries, for both loaders' readings: vLLM reads the top-level
    key as boundaries; SGLang reads eagle_config's as "output of layer k" (boundary k + 1) when its first
    id is 1 and as boundaries otherwise (sglang#25454), so the default (2, ...) is written (1, ...) there."""
    sglang = [k - 1 for k in layers] if layers[0] == 2 else list(layers)
    return {"eagle_aux_hidden_state_layer_ids": list(layers),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": True}}


def layer_ids_from_config(config: dict) -> Optional[tuple]:
    """The layer boundaries a head config names (the top-level key first, as vLLM; eagle_config's as
    SGLang reads it), or None: the target's defaults."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return checked_layers(config["eagle_aux_hidden_state_layer_ids"])
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return None
    return checked_layers([k + 1 for k in ids] if ids[0] == 1 else ids)


def draft_vocab_from_offsets(state: dict, n_draft: int, vocab_size: int, head_dir: Path) -> Optional[Tensor]:
    """The draft vocabulary's token ids (draft id + d2t[draft id]) of a checkpoint, checked against t2d;
    None when the draft vocabulary is the whole vocabulary in order."""
    if "d2t" not in state:
        if n_draft != vocab_size:
            raise CheckpointError(f"EAGLE-3 head in {head_dir} drafts {n_draft} of {vocab_size} tokens "
                                  "but has no d2t to map them")
        return None
    d2t = state["d2t"].long()
    ids = torch.arange(d2t.numel()) + d2t
    if d2t.numel() != n_draft or ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != n_draft:
        raise CheckpointError(f"EAGLE-3 head in {head_dir}: d2t does not map its {n_draft} draft tokens "
                              f"to distinct token ids below {vocab_size}")
    if "t2d" in state:
        t2d = state["t2d"].bool()
        if t2d.numel() != vocab_size or int(t2d.sum()) != n_draft or not bool(t2d[ids].all()):
            raise CheckpointError(f"EAGLE-3 head in {head_dir}: t2d does not mark the token ids d2t maps to")
    return None if n_draft == vocab_size and bool((d2t == 0).all()) else ids


def read_head_config(head_dir: Path) -> dict:
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no EAGLE head at {head_dir} (config.json missing); "
                              "train one with scripts/train_eagle.py or fetch one with scripts/download.py")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not a valid EAGLE head config ({e})") from None


def load_head(head_dir, device="cpu", dtype=torch.float32):
    """An EAGLE-1/2 head (EagleHead) or an EAGLE-3 head (Eagle3Head), as its config.json's architectures say."""
    architectures = read_head_config(Path(head_dir)).get("architectures") or []
    cls = Eagle3Head if any(a in EAGLE3_ARCHITECTURES for a in architectures) else EagleHead
    return cls.load(head_dir, device=device, dtype=dtype)
