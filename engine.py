"""The engine: rows that join, decode together and leave, one draft-verify cycle (or one plain decode step) at a
time, and the pieces every cycle is built from (sampling, the acceptance rules, the model steps, compilation).

    engine = Engine(model, max_seq_len=1024, max_rows=4, head=head, tree=parse_tree("chain-1"), compile=True)
    request = engine.add(prompt_ids, max_new_tokens=128, sampling=Sampling(0.7, top_p=0.9), stop_ids={2})
    while not request.done:
        for req, new_tokens in engine.step():   # every row that got tokens this step
            ...
    engine.cancel(request)                      # a row that is not wanted any more leaves at the next step

Each row keeps its own length: its tokens sit at slots 0..length-1 of its batch row of the target's and the
head's KV caches (model.py takes per-row slots input_pos [B, T] and per-row masks [B, 1, T, S]). A step first
gives every free row (the lowest first) the next queued request (a batch-1 prefill into that row, its first token
sampled there), then runs the rows up to the last busy one at once, in buckets of 1, 2, 4, ... rows
(row_buckets: a lone request runs one-row steps in an engine of many rows):

1. draft: the head grows a tree from each row's last committed token, one head forward of B x (the level's
   nodes) per tree level;
2. verify: the target runs once over the B x n tree nodes, each row at its own slots and rotary positions;
3. accept: each row takes its own path by its own sampling settings (accept_greedy, or the lossless
   accept_sampling), so each row's output is what it would get alone;
4. commit: each row's accepted KV entries move into place, and the head reads each row's true features.

Without a head a step decodes one token per row. A row whose request finished (stop token, token budget,
cancelled) rides along at its own length, its results ignored, until a queued request takes it (continuous
batching); its tokens stay in the caches meanwhile, so a request that continues them (a chat's next turn) takes
that row and prefills only what is new. One sequence at a time is the one-row use (Session, at the end). Static
trees (chains, the paper tree, lists of paths, a context branch) share one structure across rows; the dynamic
tree (EAGLE-2) grows each row's own tree, its mask and depths per row. Steps.compiled runs the steps as full
graphs of static shape (one per bucket, all built by warm_up), the live slot count of their masks dynamic, so
nothing recompiles as rows advance, finish and are refilled.
"""
import itertools
import json
import time
import types
import warnings
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

import gemm
from eagle_head import EagleHead
from model import SELF_CAUSAL, Transformer, cache_dtype, causal_mask, narrow_caches
from tree import ContextLookup, DynamicTree, Tree, ancestor_mask, children_of, tree_attention_mask


class UsageError(ValueError):
    """Bad command-line input; the message says what to do."""




# ---------------------------------------------------------------- sampling
TOP_P_CANDIDATES = 1024  # top-p looks for its cut among this many most probable tokens before sorting all


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings (hashable: the engine computes the rows of equal settings together)."""
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None
    top_p: float = 1.0
    # its own random numbers (a request's seed: the same seed, the same text), or None: torch's global generator.
    # A generator compares by identity, so a seeded request's rows form a sampling group of their own.
    generator: Optional[torch.Generator] = None

    @classmethod
    def seeded(cls, temperature: float = 0.0, top_k: Optional[int] = None, top_p: float = 1.0,
               seed: Optional[int] = None) -> "Sampling":
        """Settings whose draws come from a (CPU) generator seeded with seed (None: torch's global one)."""
        return cls(temperature, top_k, top_p, None if seed is None else torch.Generator().manual_seed(seed))

    def rand(self, *shape, dtype=None, device=None) -> Tensor:
        """Uniform numbers in [0, 1) from this request's generator (drawn on the CPU, then moved to device)."""
        if self.generator is None:
            return torch.rand(*shape, dtype=dtype, device=device)
        return torch.rand(*shape, dtype=dtype, generator=self.generator).to(device or "cpu")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """The target distribution after temperature, top-k and top-p; used by vanilla and EAGLE alike."""
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1.0:  # keep the most probable tokens down to the smallest prefix whose mass reaches top_p
            top = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values  # sorted, descending
            if top.shape[-1] < probs.shape[-1] and not bool((top.sum(-1) > self.top_p).all()):
                top = probs.sort(dim=-1, descending=True).values  # the prefix is longer: sort the whole row
            kept = (top.cumsum(-1) - top <= self.top_p).sum(-1, keepdim=True)  # prefix length, >= 1
            probs = probs.masked_fill(probs < top.gather(-1, kept - 1), 0.0)  # ties at the cut stay
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def draw(self, probs: Tensor, k: int = 1) -> Tensor:
        """k draws without replacement from each row of probs [..., V] (unnormalised is fine), in draw order
        [..., k], by inverse CDF: one uniform number per draw, where torch.multinomial draws V exponentials
        per row (milliseconds on a CPU at V = 49152). A row's draws past its non-zero entries are V - 1."""
        rows = probs.reshape(-1, probs.shape[-1]).double()
        out = []
        for j in range(k):
            cdf = rows.cumsum(-1)
            u = self.rand(rows.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
            index = torch.searchsorted(cdf, u, right=True).clamp_max(rows.shape[-1] - 1)  # first cdf > u
            out.append(index)
            if j + 1 < k:
                rows = rows.scatter(1, index, 0.0)
        return torch.cat(out, -1).view(*probs.shape[:-1], k)


def argmax_tokens(logits: Tensor) -> Tensor:
    """The greedy token per row of logits [..., vocab]."""
    return logits.float().argmax(-1)  # same index; on CPU a bfloat16 argmax costs 4x a float one


def sample(logits: Tensor, s: Sampling) -> Tensor:
    """A token id per row of logits [..., vocab]."""
    if s.greedy:
        return argmax_tokens(logits)
    return s.draw(s.probs(logits))[..., 0]




class HeadPrediction(NamedTuple):
    """The head's output for the m nodes it was fed."""
    hidden: Tensor  # [1, m, dim] predicted features
    logits: Tensor  # [1, m, draft vocab]
    top_logp: Tensor  # [1, m, k] the k best draft log-probs
    top_tokens: Tensor  # [1, m, k] and their token ids


def head_prediction(head: EagleHead, hidden: Tensor, k: int) -> HeadPrediction:
    """The draft distribution of predicted features and its top k (k = 1: a max, half a topk's time here)."""
    logits = head.draft_logits(hidden)
    logp = logits.float().log_softmax(-1)
    top_logp, top_index = logp.max(-1, keepdim=True) if k == 1 else logp.topk(k, dim=-1)
    return HeadPrediction(hidden, logits, top_logp, head.token_ids(top_index))


def draft_step(target: Transformer, head: EagleHead, tokens: Tensor, parent_features: Tensor,
               input_pos: Tensor, rope_pos: Tensor, mask: Tensor, k: int) -> HeadPrediction:
    """Head forward on draft nodes: tokens [1, m] paired with their parents' features [1, m, dim]."""
    return head_prediction(head, head(target.tok_embeddings(tokens), parent_features, input_pos, mask, rope_pos), k)




# what an engine changes on a model or head between calls of a compiled step: the KV caches (a row bucket's views,
# a prefill's row, reallocated by setup_caches), the RoPE tables (reallocated with them) and which layers' states
# the target returns (an EAGLE-3 head's)
CHANGING = ("k_cache", "v_cache", "rope_cos", "rope_sin", "feature_layers")


def step_guards(guards) -> list:
    """Dynamo's guard_filter_fn for the compiled steps: which of a graph's guards are checked at every call.

    Kept: every guard on the call's arguments and on globals, and those on the parts of a model or head that an
    engine changes between calls (CHANGING). Dropped: the global-state guard, which holds torch.get_num_threads()
    among grad mode, autocast and the default dtype, so that each change of the thread count (the ThreadGovernor's,
    under load) recompiled every step in the middle of a generation (tens of seconds a step with frozen, autotuned
    graphs: issue 29; a step's inductor kernels follow the thread count at run time anyway when compiled for every
    core, and the rest of that state is fixed for the steps: they run under torch.no_grad(), never under autocast);
    and the guards on everything else of the modules: their structure, attributes and weights, about 5,600 checks a
    call that cost 0.5-1.3 ms of a 10-15 ms one-row step (AMD EPYC, one thread). A compiled step therefore assumes
    that its model and head keep the modules, attributes and weights they had when it compiled (quantize or swap a
    head first, then make the Steps); an engine keeps them so."""
    keep = []
    for guard in guards:
        source = guard.orig_guard.source
        on_module = source is not None and source.is_unspecialized_nn_module()
        keep.append(guard.guard_type != "GLOBAL_STATE"
                    and (not on_module or any(name in guard.name for name in CHANGING)))
    return keep


def own_code(f: Callable, tag: str) -> Callable:
    """A copy of f with a code object of its own (named f_tag): Dynamo keeps compiled graphs, and counts
    recompiles against its limit of 8, per code object."""
    return types.FunctionType(f.__code__.replace(co_name=f"{f.__name__}_{tag}"), f.__globals__, f.__name__,
                              f.__defaults__, f.__closure__)


def compile_step(f: Callable, inductor_config: Optional[dict] = None, tag: Optional[str] = None, **options) -> Callable:
    """torch.compile(f, **options), called under torch._inductor.config.patch(inductor_config): inductor compiles at
    the first call and reads `freezing` from its config module there; passed as torch.compile(options=...) it is
    not honoured, and without frozen weights the max-autotune GEMM templates are never used (issue 29: the
    compiled code then holds no _frozen_param; the patch costs ~30 us a call). With inductor_config, f is compiled
    as a copy with a code object of its own: Dynamo keeps compiled graphs on the function's code object and
    would otherwise hand this step the graph a default compile of the same function made earlier in the process
    (as when the benchmark runs both). tag: a code object of its own for this caller too (each Engine: a process
    of many engines, e.g. three precisions at four batch sizes, would exceed Dynamo's recompile limit). Without a
    mode (CPU), the graph checks step_guards' guards at each call and its wrapper no size asserts (inductor's
    assert_size_stride on every input, ~760 a one-row step: the guards on the arguments check their shapes)."""
    if "mode" not in options:  # torch.compile takes a mode or options, not both; the governor is CPU-only
        options = {**options, "options": {"guard_filter_fn": step_guards, "size_asserts": False}}
    if inductor_config:
        tag = f"{zlib.crc32(json.dumps(inductor_config, sort_keys=True).encode()):08x}" + (f"_{tag}" if tag else "")
    if tag:
        f = own_code(f, tag)
    if not inductor_config:
        return torch.compile(f, **options)
    compiled = torch.compile(f, **options)
    # quiet: the autotuner prints every timing table to stderr (PRINT_AUTOTUNE, a module flag, and the choices'
    # stats) and reads a tensor's storage(), whose deprecation warning is torch's own, not the user's
    import torch._inductor.select_algorithm as select_algorithm

    select_algorithm.PRINT_AUTOTUNE = False
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    # and inductor's int8 linear lowering (quantize.W8A8CPULinear in frozen graphs) copies a tensor the old way
    warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning,
                            module="torch._inductor.mkldnn_lowerings")
    settings = {**inductor_config, "max_autotune_report_choices_stats": False}

    def run(*args, **kwargs):
        with torch._inductor.config.patch(settings):
            return compiled(*args, **kwargs)
    return run




def accept_greedy(tokens: list, choice: list, parents: list):
    """The deepest node whose whole root path equals the target's greedy token at each step; choice[i]
    is the target's greedy token after node i, parents precede children. (A context branch may repeat a
    head node's token: then two paths match, and the deeper one, either is correct, is taken.)
    Returns (accepted node indices, root first; bonus token = the target's choice after the last)."""
    accepted, depth, deepest = [True] + [False] * (len(tokens) - 1), [0] * len(tokens), 0
    for i in range(1, len(tokens)):
        if accepted[parents[i]] and tokens[i] == choice[parents[i]]:
            accepted[i], depth[i] = True, depth[parents[i]] + 1
            deepest = i if depth[i] > depth[deepest] else deepest
    path = [deepest]
    while path[-1]:
        path.append(parents[path[-1]])
    return path[::-1], choice[deepest]


def accept_sampling(tokens: list, logits: Tensor, children: list, sampling: Sampling,
                    draft_probs: Optional[Tensor] = None, lookup_from: Optional[int] = None):
    """Lossless multi-round verification (EAGLE paper, Algorithm 1), for drafts drawn from a law q.

    Round j tries the current node's j-th child x_j with proposal q_j against the current target r (at
    first r = p): accept with probability min(1, r(x_j) / q_j(x_j)); on rejection r becomes
    norm(max(0, r - q_j)). q_j is q = draft_probs[node] with the earlier children removed, renormalised
    (static trees at temperature > 0 draw children without replacement from q), or one-hot delta(x_j),
    where r - q_j zeroes r(x_j): the dynamic tree's best tokens (draft_probs None) and context nodes
    (index >= lookup_from, tried after the head's children). If every child is rejected, the bonus token
    is drawn from the final r. Each round is a speculative-sampling step whose output law is exactly r for
    any proposal, so every committed token follows the target p (temperature / top-k / top-p as in
    vanilla sampling). A child with q_j(x_j) = 0 (q cut short by top-k / top-p and used up) is skipped.
    tokens[i]: node i's token; children[i]: its children in the order tried; logits [n, V]: the target's
    after each node.
    """
    probs = sampling.probs(logits).cpu()  # [n, V]
    draft_probs = None if draft_probs is None else draft_probs.cpu()
    path, node = [0], 0
    while True:
        r = probs[node]
        q = None if draft_probs is None else draft_probs[node]
        for child in children[node]:
            x = tokens[child]
            if q is None or (lookup_from is not None and child >= lookup_from):
                if sampling.rand(()) < r[x]:
                    break
                r = r.clone()
                r[x] = 0.0
            else:
                if q[x] <= 0.0:
                    continue
                if sampling.rand(()) * q[x] < r[x]:
                    break
                r = (r - q).clamp_min(0.0)
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum().clamp_min(1e-30)
            r = r / r.sum()
        else:
            return path, int(sampling.draw(r))
        path.append(child)
        node = child




def check_fits(prompt_len: int, max_new_tokens: int, max_seq_len: int):
    """A prompt a session of max_seq_len tokens can answer, or a UsageError that says what to change."""
    if prompt_len == 0:
        raise UsageError("the prompt is empty; give some text with --prompt")
    if prompt_len + max_new_tokens > max_seq_len:
        raise UsageError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"--max_seq_len {max_seq_len}; raise --max_seq_len or shorten the prompt")


# ---------------------------------------------------------------- the engine's rows
@dataclass(eq=False)  # a request is itself: hashed and compared by identity
class Request:
    """One sequence: `tokens` is its prompt and the tokens committed so far (in EAGLE the last of them, the
    cycle's root, is not in the target cache yet); `length` tokens are in the target cache."""
    tokens: list
    budget: int  # new tokens still wanted
    sampling: Sampling
    stop_ids: frozenset = frozenset()
    id: int = -1  # the engine's count of requests added (-1: a spare row riding along)
    length: int = 0
    out: list = field(default_factory=list)
    done: bool = False
    finish_reason: Optional[str] = None  # "stop", "length" or "cancelled"
    accept_lengths: list = field(default_factory=list)  # draft tokens accepted per EAGLE cycle
    context: ContextLookup = field(default_factory=ContextLookup)
    first_token_at: Optional[float] = None  # time.perf_counter() when its prefill gave the first token
    head_len: int = 0  # EAGLE: positions whose pairs (f_i, t_{i+1}) the head's cache holds
    unread: list = field(default_factory=list)  # features [dim] of plain steps the head has not read yet

    def __post_init__(self):
        self.prompt_len = len(self.tokens)

    def emit(self, new: list) -> list:
        """Add new tokens to the output, cut at the budget and after a stop token; finishes the request."""
        new = new[: self.budget]
        stop = next((i + 1 for i, t in enumerate(new) if t in self.stop_ids), None)
        new = new[:stop]
        self.out += new
        self.budget -= len(new)
        if stop is not None or self.budget == 0:
            self.done, self.finish_reason = True, "stop" if stop is not None else "length"
        return new


@dataclass
class RowsDraft:
    """One cycle's drafts of every row: tokens [B, n]; a static tree's structure, shared (depths [n], tree_mask
    [n, n]), or a dynamic tree's, each row its own (depths [B, n], tree_mask [B, n, n]); parents and children:
    lists per row."""
    tokens: Tensor
    depths: Tensor
    tree_mask: Tensor
    parents: list
    children: list
    draft_probs: Optional[Tensor] = None  # [B, n, vocab] (static trees, rows that sample; None: one-hot proposals)
    lookup_from: Optional[int] = None  # context nodes from this index on


@dataclass
class BatchStats:
    """Per request: new tokens and (EAGLE) accepted drafts per cycle; for the batch: target forwards and time."""
    new_tokens: list
    accept_lengths: list
    target_forwards: int
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / max(self.total_s, 1e-9)

    def tau(self, row: int) -> float:
        """Tokens a cycle committed in this request (accepted drafts + the bonus token), on average."""
        lengths = self.accept_lengths[row]
        return (sum(lengths) + len(lengths)) / max(1, len(lengths))

    @property
    def pooled_tau(self) -> Optional[float]:
        """Tokens a cycle committed over every request's cycles (None: no EAGLE cycle ran)."""
        cycles = sum(len(a) for a in self.accept_lengths)
        return sum(sum(a) + len(a) for a in self.accept_lengths) / cycles if cycles else None


# ---------------------------------------------------------------- the model steps over rows (eager, or compiled)
def prefill_row(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor):
    """A prompt's new tokens [1, T] at slots input_pos [T]: logits at the last one [1, 1, V], features [1, T, dim]."""
    return model(tokens, input_pos, mask=mask, logits_at=slice(-1, None))


def decode_rows(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor, greedy: bool,
                features: bool = False):
    """One token per row [B, 1] at slots input_pos [B, 1]: greedy tokens [B] or logits [B, V]; with features,
    (that, the features [B, 1, dim]): an EAGLE engine's plain step keeps them for its head (a graph of its own).
    Those are the final norm's input for an EAGLE-1 head (model.forward's prenorm: Engine._reprime normalises
    them), so the graph keeps the norm fused into the LM head."""
    logits, feats = model(tokens, input_pos, mask=mask, prenorm=features)
    out = argmax_tokens(logits[:, -1]) if greedy else logits[:, -1]
    return (out, feats) if features else out


def verify_rows(model: Transformer, tokens: Tensor, input_pos: Tensor, rope_pos: Tensor, mask: Tensor, greedy: bool):
    """Every row's tree nodes [B, n]: greedy tokens [B, n] (or logits [B, n, V]) after each node, and features."""
    logits, features = model(tokens, input_pos, mask=mask, rope_pos=rope_pos)
    return (argmax_tokens(logits) if greedy else logits), features


def update_rows(model: Transformer, head: EagleHead, tokens: Tensor, features: Tensor, input_pos: Tensor,
                mask: Tensor, last: Tensor, k: int):
    """The head reads pairs (features [B, m, dim], tokens [B, m]); its prediction at index last[b] of each row."""
    hidden = head(model.tok_embeddings(tokens), features, input_pos, mask)
    return head_prediction(head, hidden[torch.arange(hidden.shape[0], device=hidden.device), last][:, None], k)


STEPS = itertools.count()  # compiled step sets made in this process (their code objects' tags)


class Steps:
    """The model steps an engine runs: the target's prefill, decode and verify; the head's draft, update (after a
    commit) and prefill (update_rows both). Steps() runs them eagerly, Steps.compiled() compiled; engines given
    the same Steps share its compiled graphs."""
    is_compiled = False
    frozen = False  # compiled with frozen weights (a frozen or autotuned kind): see gemm.pack_linears

    def __init__(self, fixed: Optional[Callable] = None, variable: Optional[Callable] = None):
        """fixed, variable: what wraps the fixed-shape steps and the two prefills (None: nothing)."""
        fixed, variable = fixed or (lambda f: f), variable or (lambda f: f)
        self.decode, self.verify, self.draft, self.head_update = map(fixed, (decode_rows, verify_rows, draft_step,
                                                                            update_rows))
        self.prefill, self.head_prefill = map(variable, (prefill_row, update_rows))

    @classmethod
    def compiled(cls, device, prefill_too: bool = False, inductor_config: Optional[dict] = None,
                     **options) -> "Steps":
        """Full graphs of static shape (a live mask's slot count is dynamic, see Engine.span; on CUDA, CUDA
        graphs), so nothing recompiles as rows advance, join and leave: each step compiles once per row bucket,
        greedy and sampling (draft_step: per tree level width). prefill_too: the prefills too, with dynamic
        shapes, in the default kind whatever inductor_config says (frozen weights with dynamic shapes had not
        finished compiling after 15 minutes); their linears take gemm's packed weights where the model has them.
        `options` go to every torch.compile call (e.g. backend=...); inductor_config (a
        tuning.COMPILE_KINDS value) is set where inductor reads it, see compile_step. The steps' code objects
        are this set's own (own_code), so its graphs count against Dynamo's recompile limit apart from others'."""
        tag = f"steps{next(STEPS)}"
        cuda = torch.device(device).type == "cuda"
        fixed = {"fullgraph": True, "dynamic": False, **({"mode": "reduce-overhead"} if cuda else {})}
        steps = cls(lambda f: compile_step(f, inductor_config, tag, **fixed, **options),
                    (lambda f: compile_step(f, None, tag, fullgraph=True, dynamic=True, **options))
                    if prefill_too else None)
        steps.is_compiled = True
        steps.frozen = bool(inductor_config and inductor_config.get("freezing"))
        limit = 64  # a graph per row bucket, greedy / sampling and tree level width: more than Dynamo's default 8
        if torch._dynamo.config.recompile_limit < limit:
            torch._dynamo.config.recompile_limit = limit
        return steps


EAGER = Steps()


def compiles_prefills(max_rows: int, device) -> bool:
    """Whether a compiled engine of max_rows compiles its prefills too (and packs its linears, gemm.py): several
    rows on a CPU (see Engine). A caller that makes the Steps itself asks here, as generate.py --batch_size does."""
    return max_rows > 1 and torch.device(device).type == "cpu"


def row_buckets(max_rows: int) -> list:
    """The row counts a step runs at: powers of two below max_rows, and max_rows (each a graph of its own when
    compiled)."""
    return sorted({min(2 ** i, max_rows) for i in range(max_rows.bit_length() + 1)})


def rows_tensor(values: list, device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def row_masks(bases: Tensor, tree_mask: Tensor, slots: int) -> Tensor:
    """[B, 1, n, slots] bool: row b's nodes at slots bases[b].. see its prefix and their ancestors (tree_mask
    [n, m], or [B, n, m] each row its own; m: the slots past the prefix they may see); slots: at least the live
    slots of the longest row, bases.max() + m (Engine.span)."""
    masks = [tree_mask if tree_mask.dim() == 2 else tree_mask[i] for i in range(len(bases))]
    return torch.stack([tree_attention_mask(int(b), m, slots) for b, m in zip(bases, masks)])[:, None]


def by_sampling(rows: list) -> dict:
    """The indices of the rows that sample (not greedy, not done), grouped by equal settings: {Sampling: [b, ...]}
    (each group's draws and probabilities are computed for its rows at once)."""
    groups: dict = {}
    for b, r in enumerate(rows):
        if not r.done and not r.sampling.greedy:
            groups.setdefault(r.sampling, []).append(b)
    return groups


class Adaptation:
    """Whether an EAGLE engine's next step speculates (a cycle) or decodes plainly, from what its steps have cost
    and committed so far, so that EAGLE is never the slower choice for long: moving averages (EMA) of a plain
    step's and a cycle's wall time, per row bucket, and of the tokens a cycle commits per row (tau; prior: the
    head's acceptance model's, where --tree auto had one, weighing as PRIOR_WEIGHT cycles: a text's first cycles
    are averaged, not swamped by the prior). It speculates while tau / t_cycle beats 1 / t_step; after MIN_RUN
    cycles below that by the margin, or EARLY in a row that accepted no draft token at all (a text the head cannot
    follow: a short answer would end before MIN_RUN), it decodes plainly, probing with PROBE cycles after `wait`
    plain steps, the wait doubling while probes lose (up to MAX_WAIT), so that text where speculation pays again
    is found. While it speculates, one plain step every REFRESH cycles keeps the price of the alternative current
    (a plain step is timed only when one runs: a noisy first price, or a machine whose load changed, would
    otherwise stand for the whole run). The choice reads only the past, so either way every token is the
    target's (greedy: vanilla's; sampling: its law)."""
    MARGIN = 0.03
    ALPHA = 0.1  # weight of the newest tau in its moving average (one cycle's tau is a noisy 1..depth+1)
    ALPHA_TIME = 0.25  # and of the newest wall time in theirs
    PRIOR_WEIGHT = 2  # cycles' worth of weight the prior tau has in a text's average
    MIN_RUN, PROBE = 8, 4  # cycles before a switch to plain steps; cycles of a probe
    EARLY = 4  # cycles in a row that commit only their bonus token: a switch before MIN_RUN
    FIRST_WAIT, MAX_WAIT = 8, 128
    REFRESH = 32  # cycles between the plain steps that re-price one while speculating

    def __init__(self, prior_tau: Optional[float] = None):
        self.prior_tau = prior_tau
        self.reset()

    def reset(self):
        """Forget every measurement (after a warm-up, whose steps' times include their compiles)."""
        self.t_step: dict = {}  # bucket -> seconds of a plain step (priced from the second on)
        self.t_cycle: dict = {}  # bucket -> seconds of a cycle
        self.seen: dict = {}  # (cycle, bucket) -> steps recorded (the first of each is not timed: a cold start)
        self.switches = 0
        self.unpriced = 0  # cycles since the last plain step
        self.new_text()

    def new_text(self):
        """A new sequence (Session.reset): the acceptance seen so far was another text's; the costs stay."""
        self.tau, self.speculating, self.run = self.prior_tau, True, 0
        self.cycles = self.misses = 0  # this text's cycles; the latest of them in a row that accepted nothing
        self.wait, self.waited, self.probing = self.FIRST_WAIT, 0, 0

    def speculate(self, bucket: int) -> bool:
        """The choice for the next step of `bucket` rows (plain steps first, to price one)."""
        if bucket not in self.t_step or (self.speculating and self.unpriced >= self.REFRESH):
            return False
        if self.speculating or self.probing or bucket not in self.t_cycle or self.tau is None:
            return True
        self.waited += 1
        if self.waited > self.wait:
            self.probing = self.PROBE
        return bool(self.probing)

    def gain(self, bucket: int) -> Optional[float]:
        """Speculation's expected speed over plain steps at this bucket (None: not priced yet)."""
        if self.tau is None or bucket not in self.t_cycle or bucket not in self.t_step:
            return None
        return self.tau / self.t_cycle[bucket] * self.t_step[bucket]

    def record(self, bucket: int, cycle: bool, seconds: float, tau: Optional[float] = None):
        """A step's wall time (and a cycle's tokens per row), and the switch it calls for. The first step of each
        kind and bucket is not timed (its first run allocates, and eager kernels warm up: 2x slower here)."""
        ema = lambda old, new, alpha: new if old is None else old + alpha * (new - old)  # noqa: E731
        self.seen[cycle, bucket] = self.seen.get((cycle, bucket), 0) + 1
        if cycle and tau is not None:  # an average of the prior and the cycles so far, until ALPHA weighs more
            self.cycles += 1
            weight = 1 / (self.cycles + (0 if self.prior_tau is None else self.PRIOR_WEIGHT))
            self.tau = ema(self.tau, tau, max(self.ALPHA, weight))
            self.misses = self.misses + 1 if tau <= 1 else 0
        if self.seen[cycle, bucket] > 1:
            times = self.t_cycle if cycle else self.t_step
            times[bucket] = ema(times.get(bucket), seconds, self.ALPHA_TIME)
        self.unpriced = self.unpriced + 1 if cycle else 0
        if not cycle:
            return
        gain = self.gain(bucket)
        if self.speculating:
            self.run += 1
            evidence = self.run >= self.MIN_RUN or self.misses >= self.EARLY
            if gain is not None and evidence and gain < 1 - self.MARGIN:
                self.speculating, self.waited, self.switches = False, 0, self.switches + 1
        elif self.probing:
            self.probing -= 1
            if not self.probing:  # the probe's verdict
                self.waited = 0
                if gain is not None and gain > 1 + self.MARGIN:
                    self.speculating, self.run, self.wait = True, 0, self.FIRST_WAIT
                    self.switches += 1
                else:
                    self.wait = min(2 * self.wait, self.MAX_WAIT)


class Schedule(Adaptation):
    """A fixed sequence of choices (True: a cycle), then cycles: how a warm-up reaches the graphs of the plain steps
    and of the head's re-priming after them."""

    def __init__(self, choices):
        super().__init__()
        self.choices = list(choices)

    def speculate(self, bucket: int) -> bool:
        return self.choices.pop(0) if self.choices else True

    def record(self, *args, **kwargs):
        pass


CACHE_USERS = weakref.WeakKeyDictionary()  # a model or head -> the engine that last wrote its caches (a weakref)


class Engine:
    """Rows decoded together by a target (and an optional EAGLE head with a static or dynamic tree): requests
    are added with their own prompt, budget, sampling and stop tokens, wait in a queue for a free row, and
    leave when done or cancelled. A finished request's row keeps its tokens in the caches (it rides along at its
    own length) until a request takes the row: a request whose prompt starts with them (the next turn of a
    chat) takes that row and prefills only what is new."""

    def __init__(self, model: Transformer, max_seq_len: int, max_rows: int, head: Optional[EagleHead] = None,
                 tree: Optional["Tree | DynamicTree"] = None, compile: bool = False,
                 inductor_config: Optional[dict] = None, steps: Optional[Steps] = None,
                 adapt: Optional[Adaptation] = None, kv_dtype: Optional[torch.dtype] = None):
        """steps: the model steps (engines may share a Steps and its compiled graphs); else compile: a Steps of
        this engine's own, compiled with inductor_config (tuning.COMPILE_KINDS: None for the default kind, or
        frozen weights, or frozen and autotuned), or eager. adapt (EAGLE): an Adaptation that chooses, step by
        step, between a cycle and a plain decode step; None: every step a cycle. kv_dtype: the target's keys and
        values (None: bf16 for bf16 weights in a compiled engine of several rows on a CPU, else model.cache_dtype's
        choice, fp32 on a CPU); bf16 halves the cache, and the steps read it with model.decode_attention, faster
        at several rows (8 rows of SmolLM2-135M, AVX-512 BF16 EPYC, one thread: a frozen vanilla step 59 -> 35 ms).
        A compiled engine of several rows on a CPU packs the model's linears for oneDNN where that is faster
        (gemm.py), and (compile, not given steps) compiles its prefills too (Steps.compiled's prefill_too): eager
        prefills spent a fifth or more of their time outside the GEMMs (SmolLM2-135M in bf16, 52-87 tokens, 8 rows,
        frozen steps, one thread, AVX-512 BF16 EPYC: 106-178 -> 82-135 ms a prompt)."""
        if head is not None and not isinstance(tree, (Tree, DynamicTree)):
            raise UsageError("EAGLE needs a tree: chain-N, paper, a list of paths, +lookup-N or dynamic-K-D-N")
        self.model, self.head, self.tree, self.batch_size = model, head, tree, max_rows
        self.max_seq_len, self.device = max_seq_len, model.output.weight.device
        several = (steps.is_compiled if steps is not None else compile) and compiles_prefills(max_rows, self.device)
        self.steps = steps or (Steps.compiled(self.device, several, inductor_config) if compile else EAGER)
        self.compiled = self.steps.is_compiled
        weights = model.tok_embeddings.weight.dtype
        self.kv_dtype = kv_dtype or (torch.bfloat16 if several and weights == torch.bfloat16
                                     else cache_dtype(weights, self.device))
        if several:  # steps of several rows (and the prefills): GEMMs packed where faster
            gemm.pack_linears(model, self.steps.frozen)
        # the slots a step's attention reads: the live ones on a CPU, the whole cache elsewhere (see span)
        self.window_live = self.device.type == "cpu"
        self.buckets = row_buckets(max_rows)
        scratch = 1 if head is None else tree.num_nodes + tree.max_depth + 1  # an unfinished cycle's slots
        self.cache_len = max_seq_len + scratch
        self.head_cache_len = None if head is None else max_seq_len + max(scratch, tree.draft_slots)
        self.setup_caches()
        if head is not None:
            self.tree = tree.to(self.device)
            if head.lm_head is None:  # a quantized target's head is bound by quantize.quantize_head_like
                head.bind(model.output.weight)
        self.queue: list = []  # requests waiting for a row
        self.rows: list = [None] * max_rows  # the request each batch row holds (None: never used yet)
        self.root: Optional[HeadPrediction] = None  # EAGLE: the head's prediction after each row's last token
        self.added = 0
        self.adapt = adapt if head is not None else None
        # counters over the engine's life (Session.generate reports a call's share): forwards after the prefills,
        # head forwards (prefills included), seconds and runs per phase of the steps
        self.target_forwards = self.head_forwards = self.plain_steps = 0  # plain_steps: an EAGLE engine's
        self.phase_s: dict = {}
        self.phase_n: dict = {}
        self.views: dict = {}  # bucket -> (the full caches, their first rows): see first_rows

    def setup_caches(self, cache_len: int = 0, head_cache_len: int = 0):
        """The target's (and head's) KV caches for batch_size rows of at least cache_len (head_cache_len) slots,
        this engine's by default: engines sharing a model share its caches (each generate call makes sure they
        fit it, reallocated only when they do not), so only one of them may hold live rows at a time."""
        self.cache_len, model = max(self.cache_len, cache_len), self.model
        if model.max_batch_size != self.batch_size or model.max_seq_len < self.cache_len or \
                model.kv_caches()[0].k_cache.dtype != self.kv_dtype:
            model.setup_caches(self.batch_size, self.cache_len, dtype=self.kv_dtype)
            self.rows, self.root = [None] * self.batch_size, None  # the caches were reallocated: rows start again
        if self.head is not None:
            self.head_cache_len = max(self.head_cache_len, head_cache_len)
            cache = self.head.attention.kv_cache
            if cache is None or cache.k_cache.shape[0] != self.batch_size or self.head.max_seq_len < self.head_cache_len:
                self.head.setup_caches(self.head_cache_len, batch_size=self.batch_size)
                self.rows, self.root = [None] * self.batch_size, None

    def span(self, end: int, head: bool = False) -> int:
        """The cache slots a step's attention reads when slot end - 1 is the last in use (masks are [.., slots]):
        on a CPU the live ones, as a step's cost there grows with them (their count is dynamic in compiled
        graphs, see live: one graph serves every length); elsewhere the whole cache, one static shape (CUDA
        graphs)."""
        return end if self.window_live else (self.head.max_seq_len if head else self.model.max_seq_len)

    def live(self, mask: Tensor) -> Tensor:
        """A fixed-shape step's mask, its slot count marked dynamic in compiled graphs (see span)."""
        if self.compiled and self.window_live:
            torch._dynamo.mark_dynamic(mask, mask.dim() - 1)
        return mask

    @contextmanager
    def phase(self, name: str):
        """Time the block as one run of phase `name` (host time: CUDA kernels count where the host waits)."""
        start = time.perf_counter()
        yield
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - start
        self.phase_n[name] = self.phase_n.get(name, 0) + 1

    # ---------------------------------------------------------------- requests
    def add(self, prompt: list, max_new_tokens: int, sampling: Optional[Sampling] = None, stop_ids=frozenset()) -> Request:
        """Queue a request (prompt: token ids); it takes a row at the next step that has one free."""
        check_fits(len(prompt), max_new_tokens, self.max_seq_len)
        request = Request(list(prompt), max_new_tokens, sampling or Sampling(), frozenset(stop_ids), id=self.added)
        self.added += 1
        self.queue.append(request)
        return request

    def cancel(self, request: Request):
        """Finish a request now (finish_reason "cancelled"): a queued one never runs, a running one's row is free
        for the next step."""
        if request in self.queue:
            self.queue.remove(request)
        if not request.done:
            request.done, request.finish_reason = True, "cancelled"

    def forget(self):
        """Finished rows forget their tokens (the next request prefills its whole prompt): each becomes a spare
        riding along at slot 1."""
        for b, row in enumerate(self.rows):
            if row is not None and row.done and row.id >= 0:
                self.rows[b] = Request([0, 0], 0, Sampling(), done=True, length=1)

    @property
    def running(self) -> int:
        """Rows holding an unfinished request."""
        return sum(r is not None and not r.done for r in self.rows)

    def pending(self) -> bool:
        """Whether a step has work: a queued request or a running row."""
        return bool(self.queue) or self.running > 0

    @torch.no_grad()
    def step(self) -> list:
        """Free rows take queued requests, then every row advances by one decode step or EAGLE cycle.
        Returns [(request, its new tokens)] for every request that got tokens this step (the first token
        comes from the prefill); a request that finished has done set."""
        # the target's features are what this engine's head reads (EAGLE-3: fused layers' states)
        self.model.feature_layers = None if self.head is None else self.head.feature_layers
        for module in (self.model, self.head):  # another engine wrote these caches: the finished rows' are gone
            if module is not None:
                user = CACHE_USERS.get(module)
                if user is None or user() is not self:
                    self.forget()
                    CACHE_USERS[module] = weakref.ref(self)
        events: dict = {}
        self._admit(events)
        if self.running:
            n = self.live_rows()
            with self.first_rows(n):  # rows past the last busy one sit the step out
                if self.head is None:
                    self._vanilla_step(self.rows[:n], events)
                elif self.adapt is None:
                    self._eagle_cycle(self.rows[:n], events)
                else:
                    self._adaptive_step(n, events)
        return list(events.items())

    def _adaptive_step(self, n: int, events: dict):
        """A cycle or a plain step, as the adaptation chooses; its wall time (and tokens per row) recorded."""
        rows = self.rows[:n]
        cycle = self.adapt.speculate(n)
        running = [r for r in rows if not r.done]
        start = time.perf_counter()
        (self._eagle_cycle if cycle else self._vanilla_step)(rows, events)
        seconds = time.perf_counter() - start
        tau = sum(r.accept_lengths[-1] + 1 for r in running) / len(running) if cycle else None
        self.adapt.record(n, cycle, seconds, tau)

    @contextmanager
    def first_rows(self, n: int):
        """Within the block the KV caches (target's and head's) are their first n rows: views made once per bucket
        and kept, since graphs compiled with frozen weights are specialised to their cache tensors' identity."""
        if n == self.batch_size:  # all of them (the caches have batch_size rows, see setup_caches)
            yield
            return
        caches = self.model.kv_caches() + ([] if self.head is None else self.head.kv_caches())
        full = [(c.k_cache, c.v_cache) for c in caches]
        bases, views = self.views.get(n, (None, None))
        if bases is None or any(a is not b for pair, now in zip(bases, full) for a, b in zip(pair, now)):
            bases, views = full, [(k[:n], v[:n]) for k, v in full]
            self.views[n] = bases, views
        for c, (k, v) in zip(caches, views):
            c.k_cache, c.v_cache = k, v
        try:
            yield
        finally:
            for c, (k, v) in zip(caches, full):
                c.k_cache, c.v_cache = k, v

    def live_rows(self) -> int:
        """The rows a step runs: the smallest bucket that holds every running request (new ones take the lowest
        free row, so one client alone runs one-row steps in an engine of many rows)."""
        last = max(b for b, r in enumerate(self.rows) if r is not None and not r.done)
        return next(n for n in self.buckets if n > last)

    @torch.no_grad()
    def warm_up(self, prompt: list, samplings=(None,), max_new_tokens: int = 4):
        """Compile every graph a step may need now: each bucket of rows (that many copies of prompt at once), with
        each of the samplings (None: greedy; a greedy step and one with sampled rows are different graphs), and
        the prefills: from slot 0, and after a held prefix (a chat's next turn; prompt's first half held)."""
        adapt = self.adapt
        try:
            for n in self.buckets:
                for s in samplings:
                    if adapt is not None:  # two plain steps, then cycles: the first one re-primes the head
                        self.adapt = Schedule([False, False])
                    self.generate([prompt] * n, max(max_new_tokens, 4), s or Sampling())
        finally:
            self.adapt = adapt
        self.forget()
        if len(prompt) >= 4:
            self.generate([prompt[: len(prompt) // 2]], 1, Sampling())
            self.generate([prompt], 1, Sampling())
            self.forget()
        if self.adapt is not None:  # the warm-up's step times include their compiles
            self.adapt.reset()

    @torch.no_grad()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset()):
        """New tokens for each of the prompts (lists of token ids), batch_size at a time (continuous batching).
        Returns the outputs in the prompts' order and BatchStats."""
        if not prompts:
            raise UsageError("no prompts to generate for: give at least one")
        for p in prompts:
            check_fits(len(p), max_new_tokens, self.max_seq_len)
        self.setup_caches()
        start, forwards = time.perf_counter(), self.target_forwards
        requests = [self.add(p, max_new_tokens, sampling, stop_ids) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        return [r.out for r in requests], BatchStats([len(r.out) for r in requests], [r.accept_lengths for r in requests],
                                                     self.target_forwards - forwards, time.perf_counter() - start)

    def held(self, b: int, prompt: list) -> int:
        """How many of prompt's first tokens row b's caches hold ready (target's and head's), leaving one at least
        to prefill: a finished request's tokens in the target cache, its pairs (f_i, t_{i+1}) in the head's."""
        row = self.rows[b]
        if row is None or row.id < 0 or not row.done:
            return 0
        tokens = row.tokens[: row.length + (self.head is not None)]  # a head pair i needs token i + 1 too
        same = next((i for i, (a, c) in enumerate(zip(tokens, prompt)) if a != c), min(len(tokens), len(prompt)))
        ready = row.length if self.head is None else min(row.length, row.head_len)  # plain steps: the head's less
        return max(0, min(same - (self.head is not None), ready, len(prompt) - 1))

    def _admit(self, events: dict):
        """Each queued request, in order, takes the free row that holds most of its prompt (the lowest of equals),
        while rows are free: prefill, first token and (EAGLE) the head's prompt, all in that row alone. A row never
        used gets a spare one-token request to ride along with, so that every row has a length and a root."""
        roots: dict = {}
        while self.queue:
            free = [b for b, r in enumerate(self.rows) if r is None or r.done]
            if not free:
                break
            request = self.queue.pop(0)
            b = max(free, key=lambda b: (self.held(b, request.tokens), -b))
            roots[b] = self._prefill(b, request, self.held(b, request.tokens))
            self.rows[b] = request
            request.first_token_at = time.perf_counter()
            events[request] = request.emit([request.tokens[-1]])
        for b, row in enumerate(self.rows):
            if row is None:
                self.rows[b] = Request([0], 0, Sampling(), done=True)
                roots[b] = self._prefill(b, self.rows[b], 0)
        if self.head is None or not roots:
            return
        if self.root is None:  # the first step: every row was just filled
            self.root = HeadPrediction(*(torch.cat(parts) for parts in zip(*(roots[b] for b in range(len(self.rows))))))
        else:
            for b, one in roots.items():
                for full, part in zip(self.root, one):
                    full[b] = part[0]

    @contextmanager
    def row_caches(self, b: int):
        """Within the block the KV caches (target's and head's) are batch row b alone (a one-row engine's are)."""
        if self.batch_size == 1:
            yield
            return
        with self.model.cache_row(b), narrow_caches([] if self.head is None else self.head.kv_caches(), b):
            yield

    def _prefill(self, b: int, row: Request, held: int) -> Optional[HeadPrediction]:
        """Row b's prompt past the `held` tokens its caches hold through the target (a batch-1 forward into row b
        of its cache), its first new token appended to row.tokens (it is not in the cache yet); with a head, the
        head reads the prompt's pairs (f_i, t_{i+1}) from held on, the first new token last, and its prediction
        there drafts the row's first tree."""
        T = len(row.tokens)
        pos = torch.arange(held, T, device=self.device)
        steps = self.steps if T - held > 1 else EAGER  # a compiled prefill's length would specialise on 1: a graph
        with self.row_caches(b):
            mask = SELF_CAUSAL if held == 0 else causal_mask(pos, self.span(T))  # the causal kernel skips half
            logits, features = steps.prefill(self.model, rows_tensor([row.tokens[held:]], self.device), pos, mask)
            row.length = T
            row.tokens.append(int(sample(logits[0, -1], row.sampling)))
            if self.head is None:
                return None
            self.head_forwards += 1
            row.head_len = T
            paired = self.head.pair_tokens(row.tokens[held + 1:], row.tokens[held:T])
            return steps.head_prefill(self.model, self.head, rows_tensor([paired], self.device), features, pos,
                                           causal_mask(pos, self.span(T, head=True)),
                                           rows_tensor([T - 1 - held], self.device), self.tree.max_rank + 1)

    # ---------------------------------------------------------------- vanilla
    def _vanilla_step(self, rows: list, events: dict):
        """One token per row (each row's last token, at its slot `length`); a finished row re-runs its slot."""
        with self.phase("decode"):
            pos = rows_tensor([[r.length] for r in rows], self.device)  # [B, 1]
            mask = self.live(causal_mask(pos, self.span(int(pos.max()) + 1))[:, None])  # [B, 1, 1, S]
            groups = by_sampling(rows)
            tokens = rows_tensor([[r.tokens[-1]] for r in rows], self.device)
            if self.head is None:
                out = self.steps.decode(self.model, tokens, pos, mask, not groups)
            else:  # an EAGLE engine decoding plainly keeps each row's feature for its head (see _reprime)
                out, features = self.steps.decode(self.model, tokens, pos, mask, not groups, True)
                self.plain_steps += 1
                for r, f in zip(rows, features[:, 0]):
                    if not r.done:
                        r.unread.append(f)
            self.target_forwards += 1
        with self.phase("sample"):
            nxt = out if not groups else argmax_tokens(out)
            for s, members in groups.items():
                index = rows_tensor(members, self.device)
                nxt[index] = sample(out[index], s)
            nxt = nxt.tolist()
        for r, token in zip(rows, nxt):
            if not r.done:
                r.length += 1
                r.tokens.append(token)
                events[r] = events.get(r, []) + r.emit([token])

    # ---------------------------------------------------------------- EAGLE
    def _eagle_cycle(self, rows: list, events: dict):
        n = len(rows)
        if any(r.unread for r in rows):
            self._reprime(rows)
        root = HeadPrediction(*(t[:n] for t in self.root))
        bases = rows_tensor([r.length for r in rows], self.device)  # each row's root slot
        groups = by_sampling(rows)
        with self.phase("draft"):  # 1.
            draft = (self._draft_dynamic(rows, bases, root) if isinstance(self.tree, DynamicTree)
                     else self._draft(rows, bases, root, groups))
        with self.phase("verify"):  # 2.
            out, features = self._verify(draft, bases, not groups)
            self.target_forwards += 1
        with self.phase("accept"):  # 3. each row its own path and bonus token
            paths, new, node_tokens = [], [], draft.tokens.tolist()
            for b, (r, tokens) in enumerate(zip(rows, node_tokens)):
                if r.done:
                    paths.append([0])
                    new.append([tokens[0]])
                    continue
                path, bonus = self._accept(draft, b, tokens, out[b], r.sampling, greedy_out=not groups)
                paths.append(path)
                new.append([tokens[i] for i in path[1:]] + [bonus])
                r.accept_lengths.append(len(path) - 1)
        with self.phase("commit"):  # 4.
            for full, part in zip(self.root, self._commit(rows, bases, paths, new, features)):
                full[:n] = part
        for r, path, tokens_b in zip(rows, paths, new):
            if not r.done:
                r.tokens += tokens_b
                r.length += len(path)
                r.head_len = r.length
                events[r] = events.get(r, []) + r.emit(tokens_b)

    def _reprime(self, rows: list):
        """Before a cycle that follows plain steps: the head reads the pairs (f_i, t_{i+1}) of each row's plain
        steps in one forward (padded to the longest, two at least; padding and a row without any write scratch
        slots only), and its prediction after a row's last token becomes that row's root."""
        m = max(2, max(len(r.unread) for r in rows))  # one re-prime graph per bucket (Dynamo specialises m == 1)
        starts = [r.length - len(r.unread) for r in rows]
        pos = rows_tensor([[s + j for j in range(m)] for s in starts], self.device)  # [B, m]
        pad = torch.zeros_like(next(r.unread[0] for r in rows if r.unread))
        feats = torch.stack([torch.stack(r.unread + [pad] * (m - len(r.unread))) for r in rows])
        if self.model.feature_layers is None:  # the final norm's input (decode_rows): the head reads its output
            feats = self.model.norm(feats)
        nxt = rows_tensor([(r.tokens[s + 1: r.length + 1] + [0] * m)[:m] for r, s in zip(rows, starts)], self.device)
        own = rows_tensor([(r.tokens[s: r.length] + [0] * m)[:m] for r, s in zip(rows, starts)], self.device)
        mask = causal_mask(pos, self.span(int(pos.max()) + 1, head=True))[:, None]
        last = rows_tensor([max(len(r.unread) - 1, 0) for r in rows], self.device)
        with self.phase("reprime"):
            pred = self.steps.head_prefill(self.model, self.head, self.head.pair_tokens(nxt, own), feats, pos, mask,
                                           last, self.tree.max_rank + 1)
        self.head_forwards += 1
        for b, r in enumerate(rows):
            if r.unread:
                for full, part in zip(self.root, pred):
                    full[b] = part[b]
                r.unread, r.head_len = [], r.length

    def _draft(self, rows: list, bases: Tensor, root, groups: dict):
        """Step 1 with a static tree (EAGLE-1), every row at once: one head forward per level on all its nodes (a
        tree of depth 1, chain-1, makes none: the root's children come from the last commit). A node of rank r is
        its parent's r-th most likely draft token (greedy rows) or r-th draw without replacement from the head's q
        through the row's temperature / top-k / top-p (rows that sample, q kept in draft_probs [B, n, vocab]:
        accepted with about sum_x min(p(x), q(x)), the argmax only with p(argmax q)); the context branch is copied
        from each row's text. Node j's head slot: base + j - 1; depth d's rotary position base + d - 1."""
        tree, head, B = self.tree, self.head, len(rows)
        k, n_head = tree.max_rank + 1, len(tree.paths) + 1
        tokens = rows_tensor([[r.tokens[-1]] for r in rows], self.device).repeat(1, tree.num_nodes)
        if tree.lookup:  # the context branch: each row's own text
            tokens[:, n_head:] = rows_tensor([r.context.propose(r.tokens, tree.lookup) for r in rows], self.device)
        draft_probs = vocab_ids = None
        if groups:
            draft_probs = torch.zeros(B, tree.num_nodes, self.model.config.vocab_size, device=self.device)
            vocab_ids = head.token_ids(torch.arange(root.logits.shape[-1], device=self.device))
        head_mask = row_masks(bases, tree.tree_mask[1:n_head, 1:n_head], self.span(int(bases.max()) + n_head - 1, head=True)) \
            if tree.draft_steps else None
        parent, parent_first = root, 0
        for depth, (first, end, parent_in_level) in enumerate(tree.levels, 1):
            tokens[:, first:end] = parent.top_tokens[:, parent_in_level, tree.ranks[first:end]]
            for s, members in groups.items():
                index = rows_tensor(members, self.device)
                q = s.probs(parent.logits[index])  # [rows, parents in level, draft vocab]
                nodes = torch.arange(parent_first, parent_first + q.shape[1], device=self.device)
                draft_probs[index[:, None, None], nodes[None, :, None], vocab_ids] = q
                tokens[index, first:end] = vocab_ids[s.draw(q, k)[:, parent_in_level, tree.ranks[first:end]]]
            if depth == len(tree.levels):
                break
            m = end - first
            pos = bases[:, None] + torch.arange(first - 1, end - 1, device=self.device)  # [B, m]
            paired = head.pair_tokens(tokens[:, first:end], tokens[:, tree.parents[first:end]])
            parent = self.steps.draft(self.model, head, paired, parent.hidden[:, parent_in_level], pos,
                                      (bases + depth - 1)[:, None].expand(B, m),
                                      self.live(head_mask[:, :, first - 1:end - 1]), k)
            self.head_forwards += 1
            parent_first = first
        parents = tree.parents.tolist()
        return RowsDraft(tokens, tree.depths, tree.tree_mask, [parents] * B, [tree.children] * B, draft_probs,
                         n_head if tree.lookup else None)

    def _draft_dynamic(self, rows: list, bases: Tensor, root) -> RowsDraft:
        """Step 1 with EAGLE-2's dynamic tree, every row at once: each row expands its
        own top_k frontier for depth levels (one head forward of B x top_k nodes per level; frontier node i of
        depth d at head slot base + (d - 1) * top_k + i), then keeps its best total_tokens nodes: each row its
        own tree (parents, depths and mask per row; one-hot proposals at any temperature)."""
        tree, head, B, K, device = self.tree, self.head, len(rows), self.tree.top_k, self.device
        batch = torch.arange(B, device=device)[:, None]
        # the candidate pool in creation order, chunked [B, ...]: tokens, cumulative log-probs, parents (pool
        # index, -1: the root), depths
        pool = [(root.top_tokens[:, 0], root.top_logp[:, 0], torch.full((B, K), -1, device=device),
                 torch.ones(B, K, dtype=torch.long, device=device))]
        frontier = torch.arange(K, device=device).repeat(B, 1)  # [B, K] pool indices
        frontier_hidden = root.hidden.expand(B, K, -1)
        frontier_slots = torch.zeros(B, K, tree.draft_slots, dtype=torch.bool, device=device)  # scratch ancestors
        root_tokens = rows_tensor([[r.tokens[-1]] for r in rows], device)  # [B, 1]
        for depth in range(1, tree.depth):
            tokens, scores, pool_parents, _ = (torch.cat(chunks, dim=1) for chunks in zip(*pool))
            own = torch.arange((depth - 1) * K, depth * K, device=device)
            frontier_slots[:, torch.arange(K, device=device), own] = True
            parent_tokens = torch.cat([root_tokens, tokens], 1).gather(1, pool_parents.gather(1, frontier) + 1)
            pred = self.steps.draft(self.model, head, head.pair_tokens(tokens.gather(1, frontier), parent_tokens),
                                    frontier_hidden, bases[:, None] + own, (bases + depth - 1)[:, None].expand(B, K),
                                    self.live(row_masks(bases, frontier_slots,
                                                        self.span(int(bases.max()) + tree.draft_slots, head=True))), K)
            self.head_forwards += 1
            child_scores = (scores.gather(1, frontier)[:, :, None] + pred.top_logp).flatten(1)  # [B, K * K]
            pool.append((pred.top_tokens.flatten(1), child_scores, frontier.repeat_interleave(K, dim=1),
                         torch.full((B, K * K), depth + 1, device=device)))
            best = child_scores.topk(K).indices  # each row's next frontier: its best K children
            frontier_slots, frontier_hidden = frontier_slots[batch, best // K], pred.hidden[batch, best // K]
            frontier = tokens.shape[1] + best
        tokens, scores, pool_parents, depths = (torch.cat(chunks, dim=1) for chunks in zip(*pool))
        # each row's best nodes by score; on equal score the shallower first, so a node's parent is always kept
        order = torch.sort(depths, dim=1, stable=True).indices
        order = order.gather(1, torch.sort(scores.gather(1, order), dim=1, descending=True, stable=True).indices)
        keep = order[:, : tree.total_tokens]
        keep = keep.gather(1, torch.sort(depths.gather(1, keep), dim=1, stable=True).indices)  # parents first
        index_of = torch.zeros(B, tokens.shape[1] + 1, dtype=torch.long, device=device)  # pool index -> node
        index_of.scatter_(1, keep + 1, torch.arange(1, tree.total_tokens + 1, device=device).repeat(B, 1))
        parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                             index_of.gather(1, pool_parents.gather(1, keep) + 1)], 1)  # [B, n]
        masks, node_depths = zip(*(ancestor_mask(p, tree.depth) for p in parents))
        parents = parents.tolist()
        return RowsDraft(torch.cat([root_tokens, tokens.gather(1, keep)], 1), torch.stack(node_depths),
                         torch.stack(masks), parents, [children_of(p) for p in parents])

    def _verify(self, draft: RowsDraft, bases: Tensor, greedy: bool):
        """Step 2: the target over every row's nodes: greedy tokens (or logits) after each node, and features."""
        n = draft.tokens.shape[1]
        input_pos = bases[:, None] + torch.arange(n, device=self.device)
        return self.steps.verify(self.model, draft.tokens, input_pos, bases[:, None] + draft.depths,
                                 self.live(row_masks(bases, draft.tree_mask, self.span(int(bases.max()) + n))), greedy)

    def _accept(self, draft: RowsDraft, b: int, tokens: list, out: Tensor, sampling: Sampling, greedy_out: bool):
        """Step 3 for row b (its node tokens as a list; out: the target's greedy tokens after each node, or with
        greedy_out False its logits): its accepted path (node indices, root first) and bonus token."""
        if sampling.greedy:
            return accept_greedy(tokens, (out if greedy_out else argmax_tokens(out)).tolist(), draft.parents[b])
        return accept_sampling(tokens, out, draft.children[b], sampling,
                               None if draft.draft_probs is None else draft.draft_probs[b], draft.lookup_from)

    def _commit(self, rows: list, bases: Tensor, paths: list, new: list, features: Tensor):
        """Step 4: each row's accepted nodes' KV entries move to the slots after its prefix, and the head reads
        their true features (pairs with the tokens that follow them), max_depth + 1 rows per row (a row's
        padding is overwritten later; a done row's path [0] moves nothing); returns the head's prediction
        after each row's last new token."""
        pad = self.tree.max_depth + 1
        index = rows_tensor([path + list(range(len(path), pad)) for path in paths], self.device)  # [B, pad]
        if any(path != list(range(len(path))) for path in paths):  # a chain's entries are in place already
            slots = bases[:, None] + torch.arange(pad, device=self.device)
            for cache in self.model.kv_caches():
                cache.move(bases[:, None] + index, slots)
        feats = features.gather(1, index[..., None].expand(-1, -1, features.shape[-1]))
        next_tokens = rows_tensor([t + [0] * (pad - len(t)) for t in new], self.device)
        own = rows_tensor([[r.tokens[-1]] + t[:-1] + [0] * (pad - len(t)) for r, t in zip(rows, new)], self.device)
        pos = bases[:, None] + torch.arange(pad, device=self.device)
        self.head_forwards += 1
        return self.steps.head_update(self.model, self.head, self.head.pair_tokens(next_tokens, own), feats, pos,
                                      self.live(causal_mask(pos, self.span(int(pos.max()) + 1, head=True))[:, None]),
                                      rows_tensor([len(p) - 1 for p in paths], self.device), self.tree.max_rank + 1)


# ---------------------------------------------------------------- one sequence at a time
@dataclass
class Stats:
    """One Session.generate call's numbers."""
    new_tokens: int = 0
    prefill_s: float = 0.0  # time to the first token
    total_s: float = 0.0
    target_forwards: int = 0  # decode / verify forwards after the prefill
    head_forwards: int = 0
    accept_lengths: list = field(default_factory=list)  # draft tokens accepted per EAGLE cycle
    plain_steps: int = 0  # EAGLE with adaptation: steps decoded plainly
    phase_s: dict = field(default_factory=dict)  # seconds spent per phase of the decode steps / EAGLE cycles
    phase_n: dict = field(default_factory=dict)  # times each phase ran

    def phase_ms(self) -> dict:
        """Mean milliseconds per run of each phase (vanilla: decode, sample; EAGLE: the four steps)."""
        return {name: 1000 * t / self.phase_n[name] for name, t in self.phase_s.items() if self.phase_n[name]}

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def tau(self) -> float:
        """Tokens committed per target forward, bonus token included."""
        return (sum(self.accept_lengths) + len(self.accept_lengths)) / max(1, len(self.accept_lengths))

    def acceptance_by_depth(self, max_depth: int) -> list:
        """Fraction of cycles whose accepted path reached depth d, d = 1..max_depth."""
        n = max(1, len(self.accept_lengths))
        return [sum(a >= d for a in self.accept_lengths) / n for d in range(1, max_depth + 1)]


class Session:
    """One sequence at a time: the engine's one-row use (the command line, chat, the benchmark). A prompt that
    extends the tokens of the last call (the next chat turn) prefills only what is new; reset() forgets them."""

    def __init__(self, model: Transformer, max_seq_len: int, head: Optional[EagleHead] = None,
                 tree: Optional["Tree | DynamicTree"] = None, steps: Optional[Steps] = None,
                 adapt: Optional[Adaptation] = None):
        self.engine = Engine(model, max_seq_len, 1, head, tree, steps=steps, adapt=adapt)
        self.model, self.head, self.tree, self.max_seq_len = model, head, self.engine.tree, max_seq_len

    def reset(self, measurements: bool = False):
        """Forget the cached conversation: the next generate prefills its whole prompt (and the adaptation starts
        from its prior acceptance). measurements: the adaptation's step times too (after a warm-up, whose steps'
        times include their compiles)."""
        self.engine.forget()
        if self.engine.adapt is not None:
            (self.engine.adapt.reset if measurements else self.engine.adapt.new_text)()

    @torch.no_grad()
    def generate(self, prompt: list, max_new_tokens: int, sampling: Sampling, stop_ids=frozenset(),
                 on_tokens: Optional[Callable] = None):
        """Generate after `prompt` (a list of token ids). Returns (new token ids, Stats).
        on_tokens(list) is called with each batch of committed tokens (for streaming)."""
        e = self.engine
        e.setup_caches()
        before = (e.target_forwards, e.head_forwards, dict(e.phase_s), dict(e.phase_n), e.plain_steps)
        start = time.perf_counter()
        request = e.add(prompt, max_new_tokens, sampling, stop_ids)
        while not request.done:
            for _, new in e.step():
                if on_tokens and new:
                    on_tokens(new)
        phases = {name: e.phase_n[name] - before[3].get(name, 0) for name in e.phase_n}
        return request.out, Stats(
            len(request.out), request.first_token_at - start, time.perf_counter() - start,
            e.target_forwards - before[0], e.head_forwards - before[1], request.accept_lengths, e.plain_steps - before[4],
            {name: e.phase_s[name] - before[2].get(name, 0.0) for name in phases if phases[name]},
            {name: n for name, n in phases.items() if n})
