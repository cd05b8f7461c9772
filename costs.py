"""Timing the pieces of an EAGLE cycle on this machine: the engine's own steps (verify, a head draft step, the
head's update forward, KV moves) over n rows after PREFIX cached tokens, timed round-robin so that load on the
machine spreads evenly over them. tuning.calibrate (a quick profile at a generate.py run's first --tree auto) and
scripts/profile_costs.py (the full profile) both time through Pieces and piece_costs.
"""
import random
import statistics
import time
from typing import Optional

import torch

from engine import (Sampling, accept_greedy, accept_sampling, argmax_tokens, compile_step, draft_step, sample,
                    update_rows, verify_rows)
from model import causal_mask

ROWS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
UPDATE_ROWS = list(range(2, 10))  # depth 1..8
PREFIX = 300
PIECES = ("verify", "draft", "update", "move")
TOP_K = 4  # draft top-k of a draft step / head update (a tree's max rank + 1; its cost hardly varies)


def rows_of(piece: str) -> list:
    return ROWS if piece in ("verify", "draft") else UPDATE_ROWS


# ---------------------------------------------------------------- the cycle's steps: the engine's own
def verify_greedy(model, tokens, input_pos, mask):
    """engine.verify_rows, greedy: the target over tokens [B, n] at slots (and rotary positions) input_pos."""
    return verify_rows(model, tokens, input_pos, input_pos, mask, True)


def compiled(fn, tag: str, inductor_config=None):
    """fn compiled as engine.Steps.compiled compiles a fixed-shape step (inductor_config: a COMPILE_KINDS value), its
    graphs its own (engine.own_code: a fixed-shape compile of verify_rows would otherwise reuse the dynamic graph,
    and four precisions would share one cache)."""
    return compile_step(fn, inductor_config, tag, fullgraph=True, dynamic=False)


def dynamic(*marks):
    """mark_dynamic (tensor, dims) pairs, except dims of size 1 (Dynamo specialises those)."""
    for tensor, dims in marks:
        for d in dims:
            if tensor.shape[d] > 1:
                torch._dynamo.mark_dynamic(tensor, d)


class Pieces:
    """A target and head (bound to each other) with PREFIX random tokens cached in each of batch_size rows, and a
    callable per piece and row count (at batch_size > 1 each piece runs its rows in every batch row, as the
    engine's batched cycle); the steps eager (mode "eager") or compiled with the row count dynamic."""

    def __init__(self, model, head, mode: str, tag: str, max_rows: int, batch_size: int = 1,
                 inductor_config: Optional[dict] = None):
        self.checkpoint = None  # where the weights came from, if a caller loaded them (scripts/profile_costs.py)
        self.prepare(model, head, mode, tag, max_rows, batch_size, inductor_config)

    def prepare(self, model, head, mode: str, tag: str, max_rows: int, batch_size: int = 1,
                inductor_config: Optional[dict] = None):
        """model and head (bound to each other) with PREFIX random tokens cached, the steps eager or compiled
        (inductor_config: a tuning.COMPILE_KINDS value, the kind of compile)."""
        self.model, self.head, self.batch_size = model, head, batch_size
        slots = PREFIX + max_rows + 16
        self.model.setup_caches(batch_size, slots)
        self.head.setup_caches(slots, batch_size=batch_size)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.model.config.vocab_size, (1, PREFIX + 1), generator=g).expand(batch_size, -1)
        pos = torch.arange(PREFIX)
        _, feats = self.model(prompt[:, :PREFIX], pos, mask=causal_mask(pos, PREFIX))
        self.head(self.model.tok_embeddings(prompt[:, 1:]), feats, pos, causal_mask(pos, PREFIX))
        self.feature = feats[:, -1:]
        self.steps = {"verify": verify_greedy, "draft": draft_step, "update": update_rows}
        if mode != "eager":
            self.steps = {k: compiled(f, tag, inductor_config) for k, f in self.steps.items()}

    def call(self, piece: str, rows: int, steps=None, rows_dynamic: bool = True):
        """A zero-argument callable running `piece` over `rows` rows (fresh inputs; the row dimension
        marked dynamic, or with rows_dynamic False only the cache slots, as generate.py does)."""
        steps, B = steps or self.steps, self.batch_size
        pos = torch.arange(PREFIX, PREFIX + rows)
        tokens = torch.randint(0, min(1000, self.model.config.vocab_size), (B, rows))
        mask = causal_mask(pos, PREFIX + rows)
        pos_dims, mask_dims = [0], [0, 1]
        if B > 1:  # the engine's batched shapes: slots [B, n] and masks [B, 1, n, S], each row its own
            pos, mask = pos.expand(B, -1).contiguous(), mask.expand(B, 1, -1, -1).contiguous()
            pos_dims, mask_dims = [1], [2, 3]
        if piece == "verify":
            dynamic(*([(tokens, [1]), (pos, pos_dims), (mask, mask_dims)] if rows_dynamic else [(mask, mask_dims[-1:])]))
            return lambda: steps["verify"](self.model, tokens, pos, mask)
        features = self.feature.expand(B, rows, -1).contiguous()
        dynamic((tokens, [1]), (pos, pos_dims), (mask, mask_dims), (features, [1]))
        if piece == "draft":
            return lambda: steps["draft"](self.model, self.head, tokens, features, pos, pos, mask, TOP_K)
        if piece == "update":
            last = torch.full((B,), rows - 1)
            return lambda: steps["update"](self.model, self.head, tokens, features, pos, mask, last, TOP_K)
        caches = self.model.kv_caches()  # move: as the engine's commit, eager
        src, dst = pos + rows, pos
        return lambda: [c.move(src, dst) for c in caches]


CALIBRATION_ROWS = {"verify": [1, 2, 3, 4, 6, 8, 12, 16], "draft": [1, 2, 4, 8], "update": [2, 3, 4, 5],
                    "move": [2, 3, 4, 5]}
CALIBRATION_REPS = 5
BATCH_ROWS = CALIBRATION_ROWS  # batched cycles: trees of up to 16 nodes (a larger batch wants a smaller tree)
# a cycle's and a vanilla step's host work beyond their forwards, measured on AVX-512 BF16 (int4 compiled, one
# thread: chain-1's phases less its forwards, results/2026-12-01-cycle-overheads); main()'s defaults
OVERHEAD_MS, DECODE_OVERHEAD_MS = 0.8, 0.25


def piece_costs(pieces_by_key: dict, rows_by_piece: dict, reps: int, seed: int = 0):
    """{key: {piece_ms: {rows: median ms}}} and the wall medians alike, of Pieces timed round-robin (every key,
    piece and row count in one rotation); each callable is warmed up (compiled) first."""
    jobs = {}
    for key, pieces in pieces_by_key.items():
        for piece, rows in rows_by_piece.items():
            for n in rows:
                jobs[key, piece, n] = pieces.call(piece, n)
                jobs[key, piece, n]()  # compiles (once per piece, and for one row) and warms up
                jobs[key, piece, n]()
    medians, wall = timed_round_robin(jobs, reps, seed)
    return ({key: {f"{piece}_ms": {str(n): medians[key, piece, n] for n in rows} for piece, rows in rows_by_piece.items()}
             for key in pieces_by_key},
            {key: {piece: {str(n): wall[key, piece, n] for n in rows} for piece, rows in rows_by_piece.items()}
             for key in pieces_by_key})


def median_ms(times: list) -> float:
    return round(statistics.median(times) * 1000, 4)


def timed_round_robin(jobs: dict, reps: int, seed: int = 0):
    """jobs: {name: callable}; each rep runs every job once in a fresh random order. Median ms per job of
    this thread's CPU time (what the call costs on an idle core: a busy machine's other processes stretch
    wall time, not it) and of wall time."""
    cpu, wall = {name: [] for name in jobs}, {name: [] for name in jobs}
    names, rng = list(jobs), random.Random(seed)
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            start_cpu, start = time.thread_time(), time.perf_counter()
            jobs[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    return {name: median_ms(t) for name, t in cpu.items()}, {name: median_ms(t) for name, t in wall.items()}


SAMPLING_NODES = [2, 3, 5, 9, 17]  # a cycle's nodes (root included): chain-1, chain-2, chain-4, ...


def sampling_costs(vocab_size: int, draft_vocab: int, reps: int = 21, seed: int = 0) -> dict:
    """Host work a step does at temperature > 0 beyond its greedy twin, medians of this thread's ms, timed on the
    engine's own functions with random logits, as Engine's steps call them: "decode_ms", a vanilla step's
    argmax and draw (engine.sample) on the step's logits, against reading the tokens a greedy graph returns;
    "cycle_ms"[n], a cycle of n nodes (a chain): the draft's law over the vocabulary (Sampling.probs of the
    head's logits, placed in a [n, vocab] table as Engine._draft does) and its draws, then
    engine.accept_sampling, against accept_greedy on the greedy graph's tokens. tuning.CycleCosts adds them
    where it prices sampling (greedy=False)."""
    g = torch.Generator().manual_seed(seed)
    s = Sampling.seeded(1.0, seed=seed)
    logits = torch.randn(max(SAMPLING_NODES), vocab_size, generator=g) * 4
    head_logits = torch.randn(max(SAMPLING_NODES), draft_vocab, generator=g) * 4
    vocab_ids = torch.randperm(vocab_size, generator=g)[:draft_vocab]

    greedy_tokens = argmax_tokens(logits)  # greedy steps take their tokens from the graph (the argmax is in it)

    def cycle(n: int, greedy: bool):
        tokens, parents, children = list(range(n)), [0] + list(range(n - 1)), [[i + 1] for i in range(n - 1)] + [[]]
        if greedy:
            return lambda: accept_greedy(tokens, greedy_tokens[:n].tolist(), parents)

        def run():
            draft_probs = torch.zeros(n, vocab_size)
            q = s.probs(head_logits[: n - 1])
            draft_probs[torch.arange(n - 1)[:, None], vocab_ids] = q
            s.draw(q)
            return accept_sampling(tokens, logits[:n], children, s, draft_probs)
        return run

    rows = torch.tensor([0])

    def sampled_step():  # as Engine._vanilla_step on the step's logits [rows, vocab]
        return argmax_tokens(logits[:1]).index_put_((rows,), sample(logits[rows], s)).tolist()

    jobs = {("decode", True): lambda: greedy_tokens[:1].tolist(), ("decode", False): sampled_step}
    for n in SAMPLING_NODES:
        jobs[n, True], jobs[n, False] = cycle(n, True), cycle(n, False)
    for job in jobs.values():
        job()
    ms = timed_round_robin(jobs, reps, seed)[0]
    extra = {name: round(max(0.0, ms[name, False] - ms[name, True]), 4) for name in ["decode"] + SAMPLING_NODES}
    return {"decode_ms": extra.pop("decode"), "cycle_ms": {str(n): v for n, v in extra.items()}}


def head_sampling_costs(model, head, reps: int = 21) -> dict:
    """sampling_costs at a target's vocabulary and its head's draft vocabulary."""
    draft_vocab = model.config.vocab_size if head.draft_vocab is None else len(head.draft_vocab)
    return sampling_costs(model.config.vocab_size, draft_vocab, reps)
