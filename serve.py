"""A local OpenAI-compatible server on the engine: several clients at once, streamed answers, and a chat page.

    python serve.py                                       # the default model at http://127.0.0.1:8000 (chat page: /)
    python serve.py --eagle --quantize int4 --compile --max_batch 4

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models, /health (503 while the
model loads and compiles), /metrics (Prometheus text) and / (chat.html).

One thread drives engine.Engine: a request takes one of its --max_batch rows as soon as one is free (the others
wait, at most --max_queue of them) and leaves it when it ends: a stop token, its token budget, a stop string, or
its client going away. The HTTP side (starlette on uvicorn, in the main thread) turns each request's new tokens
into text (TextStream): stop tokens hidden, a character split across tokens sent whole, stop strings cut and
never sent, also when one spans tokens or lies inside one EAGLE cycle's block. A request's `seed` gives it random
numbers of its own (engine.Sampling.seeded). With no flags, a greedy answer equals `python generate.py --prompt`'s.
"""
import argparse
import asyncio
import itertools
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import generate
from engine import Engine, Request, Sampling, UsageError
from model import DEFAULT_CHECKPOINT, CheckpointError
from tokenizer import TokenizerError
from tuning import COMPILE_KINDS, warm_up

PAGE = Path(__file__).resolve().parent / "chat.html"
PING_S = 1.0  # an SSE comment this often while a stream has nothing to send (a queue wait, a long prefill)
ROLES = {"system", "developer", "user", "assistant"}  # developer: OpenAI's newer name for system
# Parameters of the API that ask for something this server does not do: 400 naming them (others are ignored).
NOT_IMPLEMENTED = {
    "n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False), "top_logprobs": lambda v: v is not None,
    "echo": lambda v: bool(v), "suffix": lambda v: v is not None, "logit_bias": lambda v: bool(v),
    "tools": lambda v: bool(v), "tool_choice": lambda v: v not in (None, "none"), "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"), "presence_penalty": lambda v: v not in (None, 0),
    "frequency_penalty": lambda v: v not in (None, 0), "audio": lambda v: v is not None,
    "response_format": lambda v: v is not None and (not isinstance(v, dict) or v.get("type") != "text"),
    "modalities": lambda v: v not in (None, ["text"]),
}


class ApiError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- what a request asks for
@dataclass
class Spec:
    """A validated request: its prompt ids, token budget, sampling, stop strings and how to answer."""
    prompt: list
    max_tokens: int
    sampling: Sampling
    stops: list
    stream: bool
    include_usage: bool
    chat: bool


def number(body: dict, name: str, kind=float, low=None, high=None, low_open=False, default=None):
    """body[name] as kind, within [low, high] ((low, high] with low_open), or default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise ApiError(400, f"{name} must be in {bounds}, got {value!r}", name)
    return kind(value)


def message_text(message, i: int) -> tuple:
    """(role, content) of messages[i]: content a string or a list of text parts."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with role and content", where)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string, got {type(content).__name__}", f"{where}.content")
    return ("system" if role == "developer" else role), content


def prompt_ids(body: dict, chat: bool, tokenizer) -> list:
    """The prompt's token ids: the chat template over messages (chat), or the completion prompt (text, or ids)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        turns = [message_text(m, i) for i, m in enumerate(messages)]
        return tokenizer.encode_chat([{"role": role, "content": content} for role, content in turns])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, bos=tokenizer.bos_id is not None)  # as generate.py --raw
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt)
    raise ApiError(400, "prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def parse_spec(body, chat: bool, tokenizer, defaults, max_seq_len: int) -> Spec:
    """Validate a request body (ApiError 400 naming the field at the first problem)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, asks in NOT_IMPLEMENTED.items():
        if asks(body.get(name)):
            raise ApiError(400, f"{name} is not supported by this server; leave it out", name, "unsupported_parameter")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ApiError(400, "stream_options is only allowed with stream: true (an object)", "stream_options")
    temperature = number(body, "temperature", low=0, default=defaults.temperature)
    top_p = number(body, "top_p", low=0, high=1, low_open=True, default=defaults.top_p)
    top_k = number(body, "top_k", int, low=0, default=defaults.top_k)  # 0: off (llama.cpp's convention)
    seed = number(body, "seed", int)
    limit = number(body, "max_completion_tokens", int, low=1, default=number(body, "max_tokens", int, low=1))
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else (stops or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    prompt = prompt_ids(body, chat, tokenizer)
    if len(prompt) >= max_seq_len:
        raise ApiError(400, f"the prompt ({len(prompt)} tokens) leaves no room in the context ({max_seq_len} tokens): "
                       "shorten it, or restart the server with a larger --max_seq_len", "messages" if chat else "prompt",
                       "context_length_exceeded")
    room = max_seq_len - len(prompt)
    sampling = Sampling.seeded(temperature, top_k or None, top_p, seed if temperature > 0 else None)
    return Spec(prompt, min(limit or room, room), sampling, stops, stream,
                bool(options and options.get("include_usage")), chat)


# ---------------------------------------------------------------- tokens -> text
class TextStream:
    """The text of one answer as its tokens come: stop tokens hidden, a character split across tokens held until
    whole, and stop strings cut: text that could still become the start of one is held back, so none is sent."""

    def __init__(self, tokenizer, stops: list):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids, self.tokens, self.sent, self.text = [], 0, 0, ""
        self.stopped = False  # a stop string ended the answer
        self.tokens_used = 0  # tokens the answer took (up to the stop string, if one ended it)

    def push(self, new: list) -> str:
        """The text that is safe to send after these new tokens."""
        self.tokens += len(new)
        self.ids += [t for t in new if t not in self.tokenizer.stop_ids]
        self.tokens_used = self.tokens
        self.text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=None)
        if cut is not None:
            self.stopped, self.tokens_used = True, self.tokens_up_to(cut)
            return self.take(cut)
        full = len(self.text.rstrip("\ufffd"))  # an unfinished UTF-8 character waits for its next token
        end = min([full] + [j for s in self.stops for j in range(max(self.sent, full - len(s) + 1), full)
                            if s.startswith(self.text[j:full])])  # where a stop string may be starting
        return self.take(end)

    def finish(self) -> str:
        """What is left once the answer ended without a stop string (held-back text included)."""
        return "" if self.stopped else self.take(len(self.text))

    def take(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece

    def tokens_up_to(self, cut: int) -> int:
        """The fewest of the answer's tokens whose text reaches character cut (a binary search)."""
        low, high = 0, len(self.ids)
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if len(self.tokenizer.decode(self.ids[:mid])) < cut else (low, mid)
        return low


# ---------------------------------------------------------------- the engine thread
@dataclass(eq=False)
class Job:
    """One request between the HTTP side and the engine thread; events come back on an asyncio queue."""
    spec: Spec
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Optional[Request] = None
    submitted: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None  # when its first token came (the prefill's)
    last: Optional[float] = None
    finished: bool = False  # ended, or its cancel sent
    accept_lengths: list = field(default_factory=list)  # draft tokens accepted per EAGLE cycle, once done

    def deliver(self, *event):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop closed (shutting down)
            pass


class Metrics:
    """Counters for /metrics (the engine thread writes them; a read may be one step old)."""

    def __init__(self, max_depth: int = 0):
        self.outcomes = {k: 0 for k in ("stop", "length", "cancelled", "error", "rejected")}
        self.prompt_tokens = self.generated_tokens = self.drafts = self.draft_tokens = self.accepted = 0
        self.by_position = [0] * max_depth

    def finished(self, job: Job, outcome: str, draft_nodes: int):
        request = job.request
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.prompt_tokens += len(job.spec.prompt)
        self.generated_tokens += len(request.out)
        self.drafts += len(request.accept_lengths)
        self.draft_tokens += draft_nodes * len(request.accept_lengths)
        self.accepted += sum(request.accept_lengths)
        for length in request.accept_lengths:
            for d in range(min(length, len(self.by_position))):
                self.by_position[d] += 1

    def text(self, rows_live: int, queued: int) -> str:
        lines = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP serve_{name} {help_}", f"# TYPE serve_{name} {kind}"])
            lines.extend(f"serve_{name}{labels} {value}" for labels, value in samples)
        metric("requests_total", "counter", "Requests ended, by outcome (rejected: answered with an error before running).",
               [(f'{{outcome="{k}"}}', v) for k, v in self.outcomes.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the requests that ran.", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
        metric("drafts_total", "counter", "EAGLE cycles (one draft tree each).", [("", self.drafts)])
        metric("draft_tokens_total", "counter", "Draft tokens proposed.", [("", self.draft_tokens)])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted.", [("", self.accepted)])
        metric("accepted_tokens_by_position_total", "counter", "Cycles whose accepted path reached this depth.",
               [(f'{{position="{d + 1}"}}', v) for d, v in enumerate(self.by_position)])
        metric("mean_accepted_length", "gauge", "Tokens per EAGLE cycle: accepted drafts plus the target's own.",
               [("", round(1 + self.accepted / self.drafts, 4) if self.drafts else 0)])
        metric("rows_live", "gauge", "Engine rows holding a running request.", [("", rows_live)])
        metric("queue_length", "gauge", "Requests waiting for a row.", [("", queued)])
        return "\n".join(lines) + "\n"


class Worker(threading.Thread):
    """Loads the model, then drives the engine: requests come in through an inbox (add, cancel), every step's new
    tokens go back to their jobs. The only thread that touches the engine."""

    def __init__(self, args):
        super().__init__(daemon=True, name="engine")
        self.args, self.inbox = args, queue.Queue()
        self.ready, self.failed = threading.Event(), None
        self.engine = self.tokenizer = None
        self.jobs: dict = {}  # Request -> Job
        self.metrics, self.draft_nodes, self.in_flight = Metrics(), 0, 0
        self.on_failure = lambda: None

    def load(self):
        args = self.args
        model, self.tokenizer, head, tree = generate.load(args)
        self.engine = Engine(model, args.max_seq_len, args.max_batch, head, tree, compile=args.compile,
                             inductor_config=COMPILE_KINDS[args.compile_kind], adapt=generate.adaptation_for(args, head))
        if tree is not None:
            self.draft_nodes, self.metrics = tree.num_nodes - 1, Metrics(tree.max_depth)
        if args.compile:  # both graphs: greedy rows only, and rows that sample
            prompt = self.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
            warm_up(lambda: self.engine.warm_up(prompt, [Sampling(), Sampling(1.0)]))
        print(f"serving {describe(args, head, tree)} at http://{args.host}:{args.port}", file=sys.stderr, flush=True)

    def run(self):
        if self.args.threads:
            torch.set_num_threads(self.args.threads)
        try:
            self.load()
        except (UsageError, CheckpointError, TokenizerError, ValueError, OSError) as e:
            self.failed = str(e)
            return self.on_failure()
        except Exception as e:  # anything else while loading: still one line, and the server stops
            self.failed = f"loading the model failed: {type(e).__name__}: {e}"
            return self.on_failure()
        self.ready.set()
        while True:
            self.take_inbox(block=not self.engine.pending())
            if not self.engine.pending():
                continue
            try:
                events = self.engine.step()
            except Exception as e:  # a bug or out of memory: fail the requests in flight, start the rows afresh
                self.fail_all(f"the engine failed: {type(e).__name__}: {e}")
                continue
            now = time.perf_counter()
            for request, new in events:
                job = self.jobs.get(request)
                if job is not None:
                    job.deliver("tokens", new, now)
                    if request.done:
                        self.end(job, request.finish_reason)

    def take_inbox(self, block: bool):
        while True:
            try:
                kind, job, reason = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add" and job.finished:  # its client left while it waited in the inbox
                self.metrics.outcomes["cancelled"] += 1
            elif kind == "add":
                job.request = self.engine.add(job.spec.prompt, job.spec.max_tokens, job.spec.sampling,
                                              self.tokenizer.stop_ids)
                self.jobs[job.request] = job
            elif kind == "cancel" and job.request is not None and job.request in self.jobs:
                self.engine.cancel(job.request)
                self.end(job, reason)

    def end(self, job: Job, outcome: str):
        self.jobs.pop(job.request, None)
        self.metrics.finished(job, outcome, self.draft_nodes)
        job.deliver("done", job.request.finish_reason, list(job.request.accept_lengths))

    def fail_all(self, message: str):
        for request, job in list(self.jobs.items()):
            self.engine.cancel(request)
            self.jobs.pop(request)
            self.metrics.outcomes["error"] += 1
            job.deliver("error", message)
        self.engine.queue.clear()
        self.engine.rows, self.engine.root = [None] * self.engine.batch_size, None

    # called from the HTTP side
    def submit(self, job: Job):
        self.in_flight += 1
        self.inbox.put(("add", job, None))

    def cancel(self, job: Job, outcome: str):
        """Free the job's row at the next step (outcome: "stop" for a stop string, "cancelled" for a client gone)."""
        if not job.finished:
            job.finished = True
            self.inbox.put(("cancel", job, outcome))

    def queued(self) -> int:
        return max(0, self.in_flight - self.args.max_batch)


def describe(args, head, tree) -> str:
    what = f"EAGLE {args.tree} tree" if head is not None else "plain decoding"
    rows = f"{args.max_batch} row{'s' * (args.max_batch > 1)}"
    return f"{model_name(args)} ({what}, {rows}{', compiled' if args.compile else ''})"


def model_name(args) -> str:
    path = Path(args.checkpoint or DEFAULT_CHECKPOINT)
    return path.parent.name if path.suffix == ".pth" else path.name


# ---------------------------------------------------------------- HTTP
def create_app(worker: Worker):
    """The starlette app over a (started) worker."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    args, name, counter = worker.args, model_name(worker.args), itertools.count()

    def error(e: ApiError) -> JSONResponse:
        worker.metrics.outcomes["rejected"] += 1
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request: HttpRequest):
        if args.api_key and request.headers.get("authorization") != f"Bearer {args.api_key}":
            raise ApiError(401, "a valid API key is needed: send the header Authorization: Bearer KEY",
                           code="invalid_api_key", kind="authentication_error")

    async def read_spec(request: HttpRequest, chat: bool) -> Spec:
        check_key(request)
        if not worker.ready.is_set():
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200", code="loading",
                           kind="server_error")
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise ApiError(400, "send the body as JSON with the header Content-Type: application/json")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if isinstance(body, dict) and body.get("model") not in (None, name):
            raise ApiError(404, f"model {body.get('model')!r} not found; this server has {name!r} (GET /v1/models)",
                           "model", "model_not_found")
        spec = parse_spec(body, chat, worker.tokenizer, args, args.max_seq_len)
        if worker.in_flight >= args.max_batch + args.max_queue:
            raise ApiError(503, f"the server is busy ({args.max_queue} requests waiting); retry shortly",
                           code="queue_full", kind="server_error")
        return spec

    async def events(job: Job, text: TextStream, is_disconnected):
        """("ping", None) while waiting, ("text", piece) as text comes, then ("done", finish_reason)."""
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), PING_S)
            except asyncio.TimeoutError:
                if await is_disconnected():
                    worker.cancel(job, "cancelled")
                    return
                yield "ping", None
                continue
            if event[0] == "error":
                raise ApiError(500, event[1], code="engine_error", kind="server_error")
            if event[0] == "tokens":
                job.first, job.last = job.first or event[2], event[2]
                piece = text.push(event[1])
                if piece:
                    yield "text", piece
                if text.stopped:
                    worker.cancel(job, "stop")
                    yield "done", "stop"
                    return
            else:  # done
                job.finished, job.accept_lengths = True, event[2]
                rest = text.finish()
                if rest:
                    yield "text", rest
                yield "done", {"length": "length"}.get(event[1], "stop")
                return

    def usage(job: Job, text: TextStream) -> dict:
        n = text.tokens_used
        return {"prompt_tokens": len(job.spec.prompt), "completion_tokens": n, "total_tokens": len(job.spec.prompt) + n}

    def timings(job: Job, text: TextStream) -> dict:
        """llama-server's fields: prompt (queue wait and prefill, up to the first token) and generation times, and
        EAGLE's cycles, draft tokens and accepted draft tokens (one chunk may carry several tokens)."""
        cycles = job.accept_lengths or (list(job.request.accept_lengths) if job.request else [])
        prompt_ms = 1000 * ((job.first or time.perf_counter()) - job.submitted)
        gen_ms = 1000 * ((job.last or 0) - (job.first or 0))
        n = text.tokens_used
        out = {"prompt_n": len(job.spec.prompt), "prompt_ms": round(prompt_ms, 2),
               "prompt_per_second": round(1000 * len(job.spec.prompt) / max(prompt_ms, 1e-9), 2),
               "predicted_n": n, "predicted_ms": round(gen_ms, 2),  # from the first token to the last
               "predicted_per_second": round(1000 * (n - 1) / gen_ms, 2) if gen_ms > 0 and n > 1 else None}
        if worker.draft_nodes:
            out.update(cycles=len(cycles), draft_n=worker.draft_nodes * len(cycles), draft_n_accepted=sum(cycles),
                       accepted_length=round(1 + sum(cycles) / len(cycles), 3) if cycles else None)
        return out

    async def complete(request: HttpRequest, chat: bool):
        try:
            spec = await read_spec(request, chat)
        except ApiError as e:
            return error(e)
        job = Job(spec, asyncio.get_running_loop())
        worker.submit(job)
        text = TextStream(worker.tokenizer, spec.stops)
        stream_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(counter)}-{int(time.time() * 1000)}"
        created = int(time.time())
        base = {"id": stream_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": name}

        if not spec.stream:
            pieces, finish = [], None
            try:
                async for kind, value in events(job, text, request.is_disconnected):
                    if kind == "text":
                        pieces.append(value)
                    elif kind == "done":
                        finish = value
            except ApiError as e:
                return error(e)
            finally:
                worker.in_flight -= 1
                worker.cancel(job, "cancelled")
            if finish is None:  # the client went away
                return PlainTextResponse("", status_code=499)
            answer = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": None,
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": answer, "logprobs": None, "finish_reason": finish})
            return JSONResponse({**base, "choices": [choice], "usage": usage(job, text), "timings": timings(job, text)})

        def chunk(delta=None, finish=None, **extra) -> str:
            choice = ({"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish} if chat else
                      {"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None, "finish_reason": finish})
            data = {**base, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice],
                    **extra}
            return f"data: {json.dumps(data)}\n\n"

        async def sse():
            try:
                if chat:
                    yield chunk({"role": "assistant", "content": ""})
                async for kind, value in events(job, text, request.is_disconnected):
                    if kind == "ping":
                        yield ": ping\n\n"
                    elif kind == "text":
                        yield chunk({"content": value})
                    elif kind == "done":
                        final = timings(job, text)
                        yield chunk(finish=value, timings=final)
                        if spec.include_usage:
                            data = {**base, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "choices": [], "usage": usage(job, text), "timings": final}
                            yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as e:  # after the stream began: an error event, then [DONE]
                yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                worker.in_flight -= 1
                worker.cancel(job, "cancelled")  # a client gone mid-stream frees its row at the next step

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def completions(request):
        return await complete(request, chat=False)

    async def models(request):
        try:
            check_key(request)
        except ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                         "owned_by": "local"}]})

    async def health(request):
        if worker.ready.is_set():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(request):
        rows = worker.engine.running if worker.ready.is_set() else 0
        return PlainTextResponse(worker.metrics.text(rows, worker.queued()), media_type="text/plain; version=0.0.4")

    async def page(request):
        return FileResponse(PAGE, media_type="text/html")

    async def not_found(request, exc):
        return JSONResponse(ApiError(404, f"no route {request.method} {request.url.path}; see GET /v1/models").body(),
                            status_code=404)

    async def bad_method(request, exc):
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}").body(),
                            status_code=405)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models),
              Route("/health", health), Route("/metrics", metrics), Route("/", page)]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="An OpenAI-compatible server (and chat page) on the engine.")
    generate.add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch", type=int, default=4, help="requests decoded together (engine rows); more wait")
    p.add_argument("--max_queue", type=int, default=64, help="requests that may wait for a row; more get 503")
    p.add_argument("--api_key", help="require Authorization: Bearer API_KEY on /v1/ (default: no key)")
    args = p.parse_args(argv)
    generate.check_model_arguments(args)
    if args.max_batch < 1 or args.max_queue < 0:
        raise UsageError("--max_batch must be >= 1 and --max_queue >= 0")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.eagle and args.tree != "auto":
        generate.parse_tree(args.tree)  # a bad spec fails before the server starts
    args.batch_size, args.compile_prefill = args.max_batch, False  # what generate.load reads: --tree auto's batch
    return args


def main(argv=None):
    import uvicorn

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    worker = Worker(args)
    server = uvicorn.Server(uvicorn.Config(create_app(worker), host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=1))

    def stop():
        server.should_exit = True
    worker.on_failure = stop
    worker.start()
    server.run()
    if worker.failed:
        raise UsageError(worker.failed)
    if not server.started:
        raise UsageError(f"could not listen on {args.host}:{args.port} (in use?); choose another with --port")


if __name__ == "__main__":
    try:
        main()
    except (UsageError, CheckpointError, TokenizerError, ValueError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
