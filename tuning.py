"""Tuning policy: what this machine is measured to do, and the choices made from it.

- threads: ThreadGovernor, one thread per core other processes leave free (--threads auto);
- compile kinds: the default, frozen and autotuned inductor settings (COMPILE_KINDS), --autotune's choice;
- the cost model (CycleCosts, from scripts/profile_costs.py's profiles or a quick calibration timed by costs.py)
  and the acceptance model (the head's acceptance.json) that --tree auto (auto_tree) and --precision auto choose
  from.

The cycle itself (engine.py, generate.py) never reads a profile: generate.load asks this module once, before the
first token, and passes the answers (a tree, a precision, a compile kind) down.
"""
import heapq
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

import costs
from eagle_head import EagleHead
from engine import UsageError
from model import REPO_ROOT, ModelArgs, Transformer
from tree import chain, parse_paths, split_lookup

REFERENCE_PROFILES = REPO_ROOT / "heads" / "SmolLM2-135M-Instruct-eagle" / "cost_profiles"  # profile_costs.py's
# JSON from each kind of machine measured, shipped with the default head



# ---------------------------------------------------------------- threads on a shared machine
def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def read_proc(path: str) -> Optional[str]:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_ticks(stat: str, self_stat: str) -> tuple:
    """(busy clock ticks of all CPUs, of this process) from the texts of /proc/stat and /proc/self/stat."""
    fields = [int(x) for x in stat.split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
    own = self_stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return busy, int(own[11]) + int(own[12])  # utime + stime of every thread


def threads_for(other_busy: float, cpus: int) -> int:
    """Threads for `cpus` cores of which other processes keep `other_busy` cores' worth busy: one per core they
    leave free (a core counts as taken from 0.4 of it on: our spinning threads crowd a busy neighbour down)."""
    return max(1, cpus - int(other_busy + 0.6))


class ThreadGovernor:
    """--threads auto: as many threads as the cores other processes leave free, re-checked every `interval`
    seconds while generating (check() between steps). An OpenMP thread on a core another process holds stalls
    every barrier of every step: a vanilla step ran 10x slower at 2 threads with one core busy than at 1
    (issue 29), and no waiting policy is free when idle. Other processes' load is all CPUs' busy time less
    this process's own, so our own threads never count. Without /proc (not Linux) it leaves PyTorch's default.
    torch.set_num_threads reaches ATen's kernels at once, and inductor's too where they were compiled for every
    core (warm_up compiles them so); the change recompiles nothing (engine.step_guards)."""

    def __init__(self, cpus: int, interval: float = 1.0, read: Callable = read_proc, clock: Callable = time.monotonic):
        self.cpus, self.interval, self.read, self.clock = cpus, interval, read, clock
        self.enabled = read("/proc/stat") is not None
        self.forget()

    def forget(self):
        """Measure the load from now on (what came before, e.g. the compiler's processes, no longer counts)."""
        self.last = self.sample()

    def sample(self):
        stat, own = self.read("/proc/stat"), self.read("/proc/self/stat")
        return (self.clock(), *cpu_ticks(stat, own)) if stat and own else None

    def check(self, force: bool = False) -> int:
        """Set the thread count from the load since the last check (at most every `interval` s); returns it."""
        if self.enabled and self.last and (force or self.clock() - self.last[0] >= self.interval):
            now = self.sample()
            seconds, busy, own = (a - b for a, b in zip(now, self.last))
            if seconds > 0:
                other = max(0.0, (busy - own) / TICKS_PER_S / seconds)
                threads = threads_for(other, self.cpus)
                if threads != torch.get_num_threads():
                    torch.set_num_threads(threads)
            self.last = now
        return torch.get_num_threads()


TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
START_WINDOW_S = 0.25  # the load measured at start-up, before the thread count is first set


# ---------------------------------------------------------------- compile kinds
# Freezing folds the weights into the graphs as constants, so inductor can prepack them for oneDNN and fold
# what depends on them only; max-autotune adds its own CPU GEMM micro-kernels (AVX-512, AMX) where they beat
# the ATen / oneDNN calls, picked by timing both per matrix shape at compile time. Which pays depends on the CPU
# and precision (AVX-512 BF16, one thread, a one-row step: bf16 24.9 -> 16.1 ms frozen, 27.6 autotuned; int4
# 10.6 -> 9.9 frozen, 8.6 autotuned; up to 2x on a Xeon with AMX): scripts/profile_costs.py --autotune measures
# the three on the machine at hand, --autotune auto follows the measurement. Frozen graphs holding oneDNN-packed
# weights (bf16, int8, fp32) are rebuilt at every start (inductor's cache cannot store them); int4's are kept.
FREEZE_OPTIONS = {"freezing": True}
AUTOTUNE_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "freezing": True}
COMPILE_KINDS = {"default": None, "frozen": FREEZE_OPTIONS, "autotuned": AUTOTUNE_OPTIONS}  # --autotune off/freeze/on


def warm_up(run: Callable, governor: Optional[ThreadGovernor] = None):
    """Call run() (one short generation) so that torch.compile builds every graph now, and say how long it took and
    how many graphs came from inductor's on-disk cache (a second run of the same command reuses them). With the
    governor, inductor compiles its kernels for every core (a kernel compiled at one thread has no parallel
    loop); they then run at whatever count the governor sets, and the load the compiler made is forgotten."""
    from torch._dynamo.utils import counters

    print("Compiling the decode steps (warm-up) ...", end=" ", file=sys.stderr, flush=True)
    start, threads = time.perf_counter(), torch.get_num_threads()
    if governor is not None:
        torch.set_num_threads(governor.cpus)
    run()
    if governor is not None:
        torch.set_num_threads(threads)
        governor.forget()
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    bypass = counters["inductor"]["fxgraph_cache_bypass"]  # e.g. frozen graphs holding oneDNN-packed weights
    reused = f"all {hits} graphs from inductor's on-disk cache" if hits and not misses + bypass else \
        f"{misses + bypass} graphs built{f' ({bypass} the cache cannot keep)' if bypass else ''}, {hits} from " \
        "inductor's on-disk cache"
    print(f"{time.perf_counter() - start:.0f} s ({reused})", file=sys.stderr)


# ---------------------------------------------------------------- tree auto
# The static tree a measured profile favours: the head's acceptance model (acceptance.json beside the
# head, written by `scripts/train_eagle.py eval`) and the machine's cost model (scripts/profile_costs.py)
# in, the tree of highest predicted tokens/s out.
#
# Acceptance model: p[d-1][r] = P(the target's greedy token is the rank-r draft child of a node at depth
# d - 1 | that node was accepted), the same for every node of that depth ("positional"), independent
# between depths. A node is on the accepted path with probability prod p along its path, so
# tau = 1 + sum of those products over the draft nodes (1: the bonus token).
#
# Why the greedy expansion is exact: a valid tree holds each node's parent and its lower-rank siblings.
# A node's value (its path product) is <= its parent's (p <= 1) and, when p[d] does not increase with
# rank, <= its lower-rank siblings'. So every prerequisite of a node is worth at least as much as the
# node, the n most valuable nodes form a valid tree, and repeatedly adding the frontier node of highest
# value (Sequoia's construction) yields exactly them: the highest tau over all trees of n nodes.
# Capping the depth keeps that true (the nodes of depth <= D form a valid tree too). Where measured p
# rises with rank (noise in deep, rare cells) the expansion is still valid, only not proven best.
#
# Cost: a tree of depth D costs verify(n nodes incl. the root) + one draft step per level 1..D-1 (rows =
# the level's width; the root's children come from the previous cycle's head update) + the head update
# (D + 1 rows) + the KV moves of the accepted path (not on a chain: its path is always in place) + a
# fixed host overhead. The best tree for each (node count, depth cap) is the greedy one; auto_tree
# evaluates tau / cost for every node count and every depth cap, and every chain (which saves the KV
# moves), and keeps the best. With costs growing with rows and draft costs that do not depend on the
# level width this search is exact (a tree is matched by the greedy tree of its size and depth, a chain
# by itself: at least its tau, at most its cost); with width-dependent draft costs the greedy tree's level
# widths are taken as they come (measured draft steps grow slowly with width).


def path_value(path, p) -> float:
    """Probability that the node `path` is on the accepted path: the product of p along it (depths or
    ranks beyond p: probability 0)."""
    value = 1.0
    for d, r in enumerate(path):
        value *= p[d][r] if d < len(p) and r < len(p[d]) else 0.0
    return value


def tree_tau(paths, p) -> float:
    """Expected tokens per cycle (bonus included) of the tree `paths` under acceptance model p[d-1][r]."""
    return 1.0 + sum(path_value(path, p) for path in paths)


def accepted_depth(paths: set, ranks) -> int:
    """Draft tokens a tree accepts (greedy) when the target's token at depth d is the draft's rank
    ranks[d - 1] (a rank no node has: rejected there). paths: a set of tuples."""
    node = ()
    for r in ranks:
        if node + (r,) not in paths:
            break
        node += (r,)
    return len(node)


def greedy_order(p, max_nodes: int, max_depth: int) -> list:
    """Draft nodes (paths) in the order of the greedy expansion, at most max_nodes, depth <= max_depth:
    the first n of them are the tree of highest tau with n draft nodes (see above). Stops at value 0."""
    order, frontier = [], [(-path_value((0,), p), (0,))]
    while frontier and len(order) < max_nodes:
        neg_value, path = heapq.heappop(frontier)
        if neg_value == 0:
            break
        order.append(list(path))
        for new in (path[:-1] + (path[-1] + 1,), path + (0,)):  # its next sibling and its first child
            if len(new) <= max_depth:
                heapq.heappush(frontier, (-path_value(new, p), new))
    return order


def along(xs: list, x: float) -> float:
    """Piecewise-linear through the (rows, ms) points xs, sorted by rows, extended linearly past the last two."""
    if x <= xs[0][0]:
        return xs[0][1]
    for (x0, y0), (x1, y1) in zip(xs, xs[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = xs[-2], xs[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def frozen_ratio(profile: dict, precision: str, rows: int, kind: str = "autotuned") -> float:
    """A verify of `rows` rows compiled as `kind` ("frozen": weights frozen; "autotuned": frozen and inductor's
    max-autotune; COMPILE_KINDS) over the default compile, from the fixed-shape verifies that
    profile_costs.py --autotune timed each way (profile["autotune"]; 1, 4 and 16 rows): piecewise linear in
    log(rows) between them, flat outside; 1.0 for "default" or where the profile has no such measurement."""
    at = profile.get("autotune", {}).get(precision, {})
    if f"{kind}_ms" not in at or kind == "default":
        return 1.0
    points = sorted((math.log(n), t / d) for n, d, t in zip(at["rows"], at["default_ms"], at[f"{kind}_ms"]))
    x = math.log(rows)
    if x >= points[-1][0]:
        return points[-1][1]
    return along(points, x)


@dataclass
class CycleCosts:
    """Milliseconds of the pieces of one cycle, as {rows: ms} measured points (scripts/profile_costs.py):
    verify: the target's forward over n rows (a vanilla decode step is verify(1) + decode_overhead_ms);
    draft: a head draft step over the m nodes of a level; update: the head's update forward over r rows;
    move: the accepted path's KV moves (r rows); overhead_ms: the rest of a cycle's host work."""
    verify: dict
    draft: dict
    update: dict
    move: dict
    overhead_ms: float = 0.0
    decode_overhead_ms: float = 0.0
    sampling: dict = field(default_factory=dict)  # T > 0 only: costs.sampling_costs' host work (empty: unpriced)
    curves: dict = field(init=False, repr=False)  # the four as sorted (rows, ms) pairs, for `along`

    def __post_init__(self):
        self.curves = {name: sorted((int(k), v) for k, v in getattr(self, name).items())
                       for name in ("verify", "draft", "update", "move")}
        if self.sampling:
            self.curves["sampling"] = sorted((int(n), ms) for n, ms in self.sampling["cycle_ms"].items())

    @classmethod
    def from_profile(cls, profile: dict, precision: str, batch_size: int = 1, kind: str = "default",
                     greedy: bool = True) -> "CycleCosts":
        """One precision ("fp32", "bf16", "int8", "int4") of a profile_costs.py JSON; batch_size > 1: its
        batched cycle's pieces (profile["batches"]), the host work taken as that of one row times the rows
        (each row's accept and commit are its own Python work). kind: how the target's steps are compiled
        (generate.py --autotune: "default", "frozen" or "autotuned"), the verify curve scaled by frozen_ratio.
        greedy False: sampling's host work (profile["sampling"], where measured) is added to a step and a cycle."""
        c = profile["precisions"][precision] if batch_size == 1 else profile["batches"][str(batch_size)][precision]
        verify = c["verify_ms"]
        if kind != "default" and batch_size == 1:
            verify = {n: ms * frozen_ratio(profile, precision, int(n), kind) for n, ms in verify.items()}
        sampling = {} if greedy else profile.get("sampling", {})
        if sampling and batch_size > 1:  # each row draws and accepts on its own
            sampling = {"decode_ms": sampling["decode_ms"] * batch_size,
                        "cycle_ms": {n: ms * batch_size for n, ms in sampling["cycle_ms"].items()}}
        return cls(verify, c["draft_ms"], c["update_ms"], c["move_ms"],
                   profile.get("overhead_ms", 0.0) * batch_size, profile.get("decode_overhead_ms", 0.0) * batch_size,
                   sampling)

    @staticmethod
    def in_profile(profile: Optional[dict], precision: str, batch_size: int = 1) -> bool:
        """Whether from_profile finds this precision and batch size in the profile."""
        if not profile:
            return False
        table = profile.get("precisions", {}) if batch_size == 1 else profile.get("batches", {}).get(str(batch_size), {})
        return precision in table

    @property
    def decode_ms(self) -> float:
        return along(self.curves["verify"], 1) + self.decode_overhead_ms + self.sampling.get("decode_ms", 0.0)

    def cycle_ms(self, paths, lookup: int = 0) -> float:
        """A cycle of the tree `paths` with a context branch of `lookup` nodes (whose accepted path is not
        in place: KV moves counted whenever there is one)."""
        widths = [0] * max(len(q) for q in paths)
        for q in paths:
            widths[len(q) - 1] += 1
        depth, in_place = max(len(widths), lookup), all(w == 1 for w in widths) and not lookup
        c = self.curves
        nodes = len(paths) + 1 + lookup
        sampled = along(c["sampling"], nodes) if self.sampling else 0.0
        return (along(c["verify"], nodes) + sum(along(c["draft"], w) for w in widths[:-1])
                + along(c["update"], depth + 1) + (0.0 if in_place else along(c["move"], depth + 1)) + self.overhead_ms
                + sampled)


def reach(paths, p) -> list:
    """[1, P(A >= 1), ..., P(A >= depth), 0]: the chance that the tree's accepted path A reaches each depth
    (the nodes of one depth are disjoint events: one path is accepted)."""
    depth = max(map(len, paths))
    return [1.0] + [sum(path_value(q, p) for q in paths if len(q) == d) for d in range(1, depth + 1)] + [0.0]


def context_gain(at_least: list, joint, n: int) -> float:
    """Tokens per cycle a context branch of n nodes adds to a tree that reaches each depth with chance
    at_least (reach): a cycle accepts the longer of the head's path A and the branch's match B, P(A = a)
    from the positional model, P(B >= d | A = a) from joint[a][b], counts of cycle starts where the head's
    chain accepted a tokens and the context proposal matched b (a capped at the tree's depth; B and A
    measured together: both are long on the same easy stretches)."""
    depth = len(at_least) - 2
    rows = [list(r) for r in joint[:depth]] + [[sum(c) for c in zip(*joint[depth:])]]  # a = 0..depth
    gain = 0.0
    for a, row in enumerate(rows):
        if sum(row):  # given A = a, the branch adds its depths d = a + 1..n it reaches: E[min(B, n) - a]+
            gain += (at_least[a] - at_least[a + 1]) * sum(sum(row[d:]) for d in range(a + 1, n + 1)) / sum(row)
    return gain


def branch_taus(paths, p, lookup_joints=None) -> list:
    """tau of `paths` with a context branch of 0, 1, ... nodes; lookup_joints[n - 1]: the joint counts
    (context_gain) taken at the cycle starts of a walk with an n-node branch, so that each length is
    scored on the cycles it would run (acceptance.json's lookup.joints)."""
    at_least = reach(paths, p)
    tau = 1.0 + sum(at_least[1:])  # tree_tau
    return [tau] + [tau + context_gain(at_least, joint, n) for n, joint in enumerate(lookup_joints or [], 1)]


class AutoTree(NamedTuple):
    paths: list  # the head's nodes, for build_tree
    tau: float  # predicted tokens per cycle
    speedup: float  # predicted tokens/s over vanilla's
    lookup: int = 0  # context branch nodes

    @property
    def spec(self) -> str:
        """The --tree spec of this tree (parse_tree's input): chain-N for a chain, else its list of paths."""
        depth = len(self.paths)
        head = f"chain-{depth}" if self.paths == chain(depth) else str(self.paths)
        return head + (f"+lookup-{self.lookup}" if self.lookup else "")


def predict(spec: str, p, costs: Optional[CycleCosts], lookup_joints=None):
    """Predicted (tau, speedup over vanilla; None without costs) of the static tree `spec` (parse_tree's
    form), as auto_tree scores its candidates."""
    spec, lookup = split_lookup(spec)
    paths = parse_paths(spec)
    taus = branch_taus(paths, p, lookup_joints)
    tau = taus[min(lookup, len(taus) - 1)]  # a branch longer than any counted match adds nothing more
    return tau, None if costs is None else tau / costs.cycle_ms(paths, lookup) * costs.decode_ms


def auto_tree(p, costs: CycleCosts, max_nodes: int = 64, margin: float = 0.0, lookup_joints=None) -> AutoTree:
    """The static tree of at most max_nodes draft nodes with the highest predicted tokens/s,
    tau / cycle_ms, under acceptance model p[d-1][r] and `costs`; with lookup_joints (branch_taus) also
    the length of its context branch (0 included), head and context nodes counted together. Its
    predicted speedup over vanilla = (tau / cycle_ms) * decode_ms; below 1 vanilla decoding is predicted
    faster than any tree. With `margin` > 0 a tree must be predicted that much faster than every smaller
    one to be chosen (the smallest within margin of the best wins): the model's error then decides nothing.
    Never more nodes than the verify curve was measured for (past its last point it is only extrapolated)."""
    max_nodes = min(max_nodes, costs.curves["verify"][-1][0] - 1)
    candidates = []
    chains = [chain(n) for n in range(1, min(len(p), max_nodes) + 1)]
    for depth_cap in range(1, len(p) + 1):
        order = greedy_order(p, max_nodes, depth_cap)
        for paths in [order[:n] for n in range(1, len(order) + 1)] + (chains if depth_cap == 1 else []):
            taus = branch_taus(paths, p, lookup_joints)
            for lookup, tau in enumerate(taus[: max_nodes - len(paths) + 1]):
                candidates.append(AutoTree(paths, tau, tau / costs.cycle_ms(paths, lookup) * costs.decode_ms, lookup))
    best = max(c.speedup for c in candidates)
    return min((c for c in candidates if c.speedup >= best * (1 - margin) - 1e-12),
               key=lambda c: len(c.paths) + c.lookup)


def instruction_set(cpuinfo: Optional[str] = None) -> str:
    """The widest of amx / avx512_bf16 / avx512 / avx2 the CPU has (its flags in cpuinfo, default
    /proc/cpuinfo), else the machine (aarch64, ...): what the cost curves and the fastest precision depend on."""
    path = Path("/proc/cpuinfo")
    text = cpuinfo if cpuinfo is not None else path.read_text() if path.is_file() else ""
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    for name, needs in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if needs in flags:
            return name
    return platform.machine() or "unknown"


def cpu_family(cpuinfo: Optional[str] = None) -> Optional[str]:
    """"family F model M" of the CPU (/proc/cpuinfo, or the text cpuinfo), None where it does not say: CPUs of
    one instruction set run the same steps at different speeds (on the two AVX-512 BF16 EPYC families met,
    max-autotune took a one-row bf16 step from 47.0 to 17.8 ms on one and from 24.9 to 27.6 ms on the other), so
    cost profiles record it."""
    path = Path("/proc/cpuinfo")
    text = cpuinfo if cpuinfo is not None else path.read_text() if path.is_file() else ""
    family, model = (re.search(rf"^{key}\s*:\s*(\d+)", text, re.M) for key in ("cpu family", "model"))
    return f"family {family.group(1)} model {model.group(1)}" if family and model else None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def same_cpu(recorded: Optional[str], machine: Optional[str]) -> bool:
    """Whether a profile measured on the CPU `recorded` ("family F model M", or "family F" where the model was not
    recorded) holds for this machine's `machine` (cpu_family())."""
    return bool(recorded and machine) and (machine == recorded or machine.startswith(recorded + " "))


def cost_profile_path(threads: int) -> Path:
    """Where scripts/profile_costs.py keeps this machine's cost profile: keyed by instruction set, thread
    count and torch version, what the curves depend on."""
    key = f"{instruction_set()}-t{threads}-torch{torch.__version__}"
    return Path.home() / ".cache" / "eagle-fast" / f"costs-{key}.json"



# ---------------------------------------------------------------- profiles and the auto choices
PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# A larger tree must be predicted this much faster to be chosen: the acceptance model (held-out ShareGPT
# answers) is optimistic on MT-bench, more so the deeper the node (80 first turns, int4: tau +9% for chain-1,
# +15% for chain-2), so a smaller margin lets the model's error pick. At 2 threads chain-2 was predicted
# 2.8% faster than chain-1 and measured 1.07x against chain-1's 1.12x
# (results/2026-12-01-amd-epyc-2cpu-avx512-bf16-mtbench80-auto-t2); 2% had let it through.
AUTO_TREE_MARGIN = 0.05


def precision_of(model: Transformer) -> str:
    """fp32 / bf16 / int8 / int4: the names of cost profiles."""
    return model.quantization["mode"] if model.quantization else PRECISIONS[model.tok_embeddings.weight.dtype]


def profile_model(config: ModelArgs) -> str:
    """The target shape a cost profile holds (its curves depend on it; scripts/profile_costs.py writes it)."""
    c = config
    return f"dim{c.dim}-layers{c.n_layer}-heads{c.n_head}/{c.n_local_heads}-ffn{c.intermediate_size}-vocab{c.vocab_size}"


def cost_profile(config: ModelArgs) -> tuple:
    """(path, the cost profile at this thread count for a target of config's shape, or None, and the shape the
    machine's own profile holds when it is another model's, else None). This machine's own profile
    (scripts/profile_costs.py), else the shipped reference profile of this instruction set and thread count
    (REFERENCE_PROFILES) when it is of this model and was measured on a CPU of this family (cpu_family:
    one instruction set's CPUs differ); its table of compile kinds (profile_costs --autotune) only where that
    was measured on such a CPU too ("autotune_cpu_family", where it differs from the curves')."""
    threads = torch.get_num_threads()
    path = cost_profile_path(threads)
    profile = json.loads(path.read_text()) if path.is_file() else None
    measured = profile and profile.get("model", "not recorded: profiled before profiles named their model")
    other = measured if profile and measured != profile_model(config) else None
    reference = REFERENCE_PROFILES / f"{instruction_set()}-t{threads}.json"
    if (profile is None or other) and reference.is_file():
        shipped, cpu = json.loads(reference.read_text()), cpu_family()
        if shipped.get("model") == profile_model(config) and same_cpu(shipped.get("cpu_family"), cpu):
            if not same_cpu(shipped.get("autotune_cpu_family", shipped["cpu_family"]), cpu):
                shipped.pop("autotune", None)  # frozen_ratio 1, --autotune auto: the default compile
            return reference, shipped, None
    return path, None if other else profile, other


def profile_source(path: Path) -> str:
    """Which profile a choice came from, for its status line."""
    if path.parent == REFERENCE_PROFILES or path.name.startswith("calibration-"):
        what = f"reference cost profile {path.stem} of the shipped head (CPU {json.loads(path.read_text())['cpu_family']})" \
            if path.parent == REFERENCE_PROFILES else f"this machine's quick calibration {path.name}"
        return f"{what}; python scripts/profile_costs.py --threads {torch.get_num_threads()} measures it in full"
    return f"this machine's cost profile {path.name}"


def profile_hint(other: Optional[str]) -> str:
    """The command that measures a missing profile (for another model than the one measured: with --checkpoint)."""
    threads = torch.get_num_threads()
    return (f"python scripts/profile_costs.py --threads {threads} measures one" if other is None else
            f"the one there is of another model ({other}); python scripts/profile_costs.py --threads {threads} "
            "--checkpoint DIR --eagle_head DIR measures this one")


@torch.no_grad()
def calibrate(model: Transformer, head: EagleHead, precision: str, mode: str, batch_size: int = 1,
              kind: str = "default") -> dict:
    """A quick cost profile of one precision, from the target and head a generate.py run has loaded: the four
    pieces of a cycle (costs.Pieces) at costs.CALIBRATION_ROWS (verify up to 16 rows: the trees a calibrated curve
    can choose from), medians of CALIBRATION_REPS round-robin timings, eager or compiled (rows dynamic) as the run
    is, compiled the way the run's steps are (kind: COMPILE_KINDS, --autotune; the head's steps too); with
    batch_size > 1 the pieces of a batched cycle of that many rows (profile["batches"]). 6 s eager for int4 here,
    4 min compiled (with the cores shared); calibrated_costs caches it. scripts/profile_costs.py's full profile
    replaces it."""
    start = time.perf_counter()
    pieces = costs.Pieces(model, head, mode, f"calibration_{precision}_b{batch_size}_{kind}",
                          max(costs.CALIBRATION_ROWS["verify"]), batch_size, COMPILE_KINDS[kind])
    measured = costs.piece_costs({precision: pieces}, costs.CALIBRATION_ROWS, costs.CALIBRATION_REPS)[0]
    threads = torch.get_num_threads()
    return {"key": cost_profile_path(threads).stem.removeprefix("costs-"), "isa": instruction_set(),
            "cpu": cpu_name(), "cpu_family": cpu_family(), "threads": threads, "torch": torch.__version__,
            "date": date.today().isoformat(), "model": profile_model(model.config), "calibration": True,
            "mode": "eager" if mode == "eager" else "compiled, rows dynamic (1 row: its own graph)",
            "kind": "eager" if mode == "eager" else kind, "reps": costs.CALIBRATION_REPS, "prefix_len": costs.PREFIX,
            "overhead_ms": costs.OVERHEAD_MS, "decode_overhead_ms": costs.DECODE_OVERHEAD_MS,
            "sampling": costs.head_sampling_costs(model, head),
            "precisions": measured if batch_size == 1 else {},
            "batches": {} if batch_size == 1 else {str(batch_size): measured},
            "wall_s": round(time.perf_counter() - start, 1)}


def calibrated_costs(model: Transformer, head: EagleHead, mode: str, batch_size: int = 1, kind: str = "default",
                     greedy: bool = True):
    """(CycleCosts, path) of this machine's quick calibration at the model's precision, this thread count and batch
    size, run now and cached if missing (calibrate: seconds eager, minutes compiled, once);
    None for an EAGLE-3 head, which profile_costs cannot time."""
    from eagle_head import Eagle3Head

    if isinstance(head, Eagle3Head):
        return None
    precision = precision_of(model)
    full = cost_profile_path(torch.get_num_threads())  # costs-<key>.json: the calibration sits beside it
    kind = "default" if mode == "eager" else kind  # eager steps are the same whatever --autotune says
    suffix = f"-{mode}" + (f"-{kind}" if kind != "default" else "")
    path = full.with_name(full.name.replace("costs-", "calibration-").replace(".json", f"{suffix}.json"))
    profile = json.loads(path.read_text()) if path.is_file() else {}
    if profile.get("model") != profile_model(model.config) or not CycleCosts.in_profile(profile, precision, batch_size):
        batch = f", batch {batch_size}" if batch_size > 1 else ""
        print(f"tree auto: no cost profile of this machine for {precision} at {plural(torch.get_num_threads(), 'thread')}{batch}; "
              f"calibrating (once, kept in {path}) ...", end=" ", file=sys.stderr, flush=True)
        if head.lm_head is None:
            head.bind(model.output.weight)
        fresh = calibrate(model, head, precision, mode, batch_size, kind)
        if profile.get("model") == fresh["model"]:  # keep what was calibrated before
            fresh["precisions"] = {**profile.get("precisions", {}), **fresh["precisions"]}
            batches = profile.get("batches", {})
            for b, table in fresh["batches"].items():
                batches[b] = {**batches.get(b, {}), **table}
            fresh["batches"] = batches
        profile = fresh
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1))
        print(f"{profile['wall_s']:.0f} s", file=sys.stderr)
    return CycleCosts.from_profile(profile, precision, batch_size, greedy=greedy), path


def cycle_models(head_dir: Path, model: Transformer, device: str, calibrate_with: Optional[tuple] = None,
                 batch_size: int = 1, kind: str = "default", greedy: bool = True):
    """What --tree auto predicts from: this machine's cost model at the model's precision and this thread
    count (scripts/profile_costs.py) and the head's acceptance model (acceptance.json beside it, written by
    scripts/train_eagle.py eval); with calibrate_with = (head, mode) and no profile for this precision, a quick
    calibration of this machine (calibrated_costs); batch_size > 1: the batched cycle's costs; kind: of steps
    compiled so (COMPILE_KINDS, --autotune; frozen_ratio); greedy False: sampling's host work priced too. Returns (CycleCosts, acceptance dict, the
    profile's path), or (None, why not: one line, None)."""
    precision, threads, acceptance = precision_of(model), torch.get_num_threads(), head_dir / "acceptance.json"
    path, profile, other = cost_profile(model.config)
    costs = profile if device == "cpu" and profile else {"precisions": {}}
    if not acceptance.is_file():
        return None, (f"{acceptance.name} is missing beside the head: python scripts/train_eagle.py eval --head "
                      f"{head_dir} writes it"), None
    if not CycleCosts.in_profile(costs, precision, batch_size):
        calibrated = calibrated_costs(model, *calibrate_with, batch_size, kind, greedy) \
            if calibrate_with and device == "cpu" else None
        if calibrated is None:
            batch = f", batch {batch_size}" if batch_size > 1 else ""
            why = f"no cost profile of this machine for {precision} at {plural(threads, 'thread')}{batch}: {profile_hint(other)}"
            return None, why, None
        return calibrated[0], json.loads(acceptance.read_text()), calibrated[1]
    return (CycleCosts.from_profile(costs, precision, batch_size, kind, greedy), json.loads(acceptance.read_text()),
            path)


def fastest_precision(config: ModelArgs, head_dir: Optional[Path], greedy: bool = True,
                      autotune: str = "off") -> str:
    """--precision auto: of the precisions in this machine's cost profile, the one predicted fastest: by a
    vanilla decode step's time, or with head_dir (--eagle) by that times the speedup of --tree auto's tree
    there (the head's acceptance.json; a context branch only when greedy, as auto_tree_for). autotune: the
    --autotune choice of a compiled run ("off" when not compiled): each precision is costed as it would compile."""
    _, profile, other = cost_profile(config)
    if profile is None:
        raise UsageError(f"--precision auto needs this machine's cost profile at {torch.get_num_threads()} "
                         f"threads of this model: {profile_hint(other)}")
    acceptance = head_dir and head_dir / "acceptance.json"
    acceptance = json.loads(acceptance.read_text()) if acceptance and acceptance.is_file() else None
    speeds = {}
    for precision in profile["precisions"]:
        kind = AUTOTUNE_CHOICES.get(autotune) or auto_compile_kind(profile, precision)
        costs = CycleCosts.from_profile(profile, precision, kind=kind, greedy=greedy)
        gain = best_tree(acceptance, costs, greedy).speedup if acceptance else 1.0
        speeds[precision + f" {kind}" * (kind != "default")] = 1000 / costs.decode_ms * gain
    best = max(speeds, key=speeds.get)
    print(f"precision auto: {best} (predicted tokens/s{' with EAGLE' if acceptance else ''}: "
          + ", ".join(f"{p} {v:.0f}" for p, v in sorted(speeds.items(), key=lambda kv: -kv[1])) + ")", file=sys.stderr)
    return best.split()[0]


def best_tree(acceptance: dict, costs: CycleCosts, greedy: bool = True):
    """auto_tree's choice (an AutoTree) under the head's acceptance model and `costs`, as --tree auto
    scores trees: acceptance_p's model, AUTO_TREE_MARGIN, and a context branch only when greedy (its match counts
    are greedy ones)."""
    joints = acceptance.get("lookup", {}).get("joints") if greedy else None
    return auto_tree(acceptance_p(acceptance, greedy), costs, margin=AUTO_TREE_MARGIN, lookup_joints=joints)


def acceptance_p(acceptance: dict, greedy: bool = True) -> list:
    """The acceptance model auto_tree scores trees with: the greedy one, or when sampling the one measured
    at temperature 1 (acceptance.json's "sampled": drafts drawn from the head's q, lossless verification; lower
    than greedy's), the greedy one for a head evaluated before it existed (optimistic when sampling)."""
    return acceptance["p"] if greedy else acceptance.get("sampled", {}).get("p", acceptance["p"])


def auto_tree_choice(head_dir: Path, model: Transformer, device: str, greedy: bool = True,
                     calibrate_with: Optional[tuple] = None, batch_size: int = 1, kind: str = "default"):
    """--tree auto: the static tree (and context branch), an AutoTree with its predicted tau and speedup,
    that auto_tree predicts fastest from cycle_models, said on stderr; None with a one-line hint when either
    model is missing. The context branch only when greedy: its match counts are greedy ones, and sampled text
    repeats itself less (on the 80 MT-bench first turns at T=1 chain-1+lookup-2 ran at 0.91x where chain-1 ran
    at 1.04x). batch_size > 1: the tree for batched cycles of that many rows (the paper: a larger batch wants a
    smaller tree). kind: for steps compiled so (COMPILE_KINDS, --autotune), whose rows cost otherwise."""
    costs, acceptance, path = cycle_models(head_dir, model, device, calibrate_with, batch_size, kind, greedy)
    if costs is None:
        print(f"tree auto: chain-1 ({acceptance})", file=sys.stderr)
        return None
    best = best_tree(acceptance, costs, greedy)
    batch = f", batch {batch_size}" if batch_size > 1 else ""
    slower = "; vanilla decoding is predicted faster" if best.speedup < 1 else ""
    print(f"tree auto: {best.spec} (predicted tau {best.tau:.2f}, {best.speedup:.2f}x over vanilla "
          f"{precision_of(model)}{f' {kind}' * (kind != 'default')}, {plural(torch.get_num_threads(), 'thread')}{batch}{slower}; "
          f"{profile_source(path)})",
          file=sys.stderr)
    return best


def auto_tree_for(*args, **kwargs) -> str:
    """The spec of auto_tree_choice's tree (same arguments); chain-1 when it has none."""
    best = auto_tree_choice(*args, **kwargs)
    return "chain-1" if best is None else best.spec


AUTOTUNE_CHOICES = {"off": "default", "freeze": "frozen", "on": "autotuned"}  # --autotune: COMPILE_KINDS' key


def auto_compile_kind(profile: Optional[dict], precision: str) -> str:
    """--autotune auto: the COMPILE_KINDS kind that profile_costs.py --autotune measured fastest at this
    precision, at least profile_costs.AUTOTUNE_MARGIN faster than the default, among those inductor's on-disk
    cache keeps (the others rebuild every graph at each start: a minute or more); "default" without such a
    measurement. A profile of before the three kinds holds {"faster": bool}, the autotuned kind's verdict."""
    at = (profile or {}).get("autotune", {}).get(precision, {})
    return at.get("auto", "autotuned" if at.get("faster") else "default")


def compile_kind(choice: str, model: Transformer, device: str) -> str:
    """The COMPILE_KINDS kind that --autotune auto / on / freeze / off takes for this model (auto: this
    machine's cost profile, auto_compile_kind; said on stderr when it freezes)."""
    if choice != "auto":
        return AUTOTUNE_CHOICES[choice]
    path, profile, _ = cost_profile(model.config)
    kind = auto_compile_kind(profile, precision_of(model)) if device == "cpu" else "default"
    if kind != "default":
        what = "weights frozen" + (" and inductor max-autotune" if kind == "autotuned" else "")
        print(f"compile: {what} (measured faster here for {precision_of(model)}, {path.name})", file=sys.stderr)
    return kind
