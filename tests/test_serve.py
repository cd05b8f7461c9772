"""serve.py as a running process: the real `openai` client and raw HTTP (http.client), a tiny model for most tests
and the default model for a few; the chat page in a real headless browser (skipped where none is installed)."""
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.bench_common import build_quick_checkpoint, chromium_driver
from scripts.benchmark_serve import free_port

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Tell me about owls.", "Write a haiku about rain.", "What is a prime number?", "Name three rivers.",
           "How do bees make honey?", "Why is the sky blue?"]


class Server:
    """python serve.py ... on a free port, until stop()."""

    def __init__(self, *flags, wait=True):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(self.port), "--threads", "1", *flags],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.base = f"http://127.0.0.1:{self.port}"
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=600):
        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve.py exited: {self.proc.stderr.read()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("serve.py did not become ready")

    def connection(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path):
        c = self.connection(10)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def post(self, path, body, content_type="application/json", headers=None):
        """Raw HTTP: (status, parsed JSON or text)."""
        c = self.connection()
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        c.request("POST", path, body=data, headers={"Content-Type": content_type, **(headers or {})})
        r = c.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text

    def client(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=self.base + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)

    def metrics(self) -> dict:
        """/metrics as {name{labels}: value}."""
        text = self.get("/metrics")[1]
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_quick_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["vanilla", "eagle"])
def server(request, tiny):
    """A tiny-model server, plain and with EAGLE (chain-3: blocks of several tokens per cycle)."""
    checkpoint, head = tiny
    flags = ["--checkpoint", str(checkpoint), "--max_batch", "4"]
    if request.param == "eagle":
        flags += ["--eagle", "--eagle_head", str(head), "--tree", "chain-3"]
    s = Server(*flags)
    s.kind = request.param
    yield s
    s.stop()


def generate_py(checkpoint, prompt, max_new_tokens, *flags) -> str:
    """generate.py's text for one prompt (stdout, without its closing newline)."""
    out = subprocess.run([sys.executable, "generate.py", "--checkpoint", str(checkpoint), "--prompt", prompt,
                          "--max_new_tokens", str(max_new_tokens), "--threads", "1", *flags], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return out.stdout[:-1]


def stream_chat(client, **kwargs):
    """(text, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_greedy_chat_streamed_equals_plain_equals_generate(server, tiny):
    """T = 0: the streamed text equals the non-streamed one and generate.py's (fp32), alone and while four other
    requests run; usage exact, finish_reason length, the chunks shaped as the API says."""
    client, model = server.client(), "tiny"
    models = client.models.list().data
    assert len(models) == 1
    model = models[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].finish_reason == "length"
    prompt_tokens = plain.usage.prompt_tokens
    assert (plain.usage.completion_tokens, plain.usage.total_tokens) == (40, prompt_tokens + 40)
    assert text == generate_py(tiny[0], PROMPTS[0], 40)

    streamed, chunks = stream_chat(client, stream_options={"include_usage": True}, **ask)
    assert streamed == text
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.choices[0].delta.role is None
                                                                   for c in chunks[1:] if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == prompt_tokens

    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # the same request among four others
        others = [pool.submit(stream_chat, client, model=model, messages=[{"role": "user", "content": p}],
                              max_tokens=60, temperature=0) for p in PROMPTS[1:5]]
        again = pool.submit(stream_chat, client, **ask)
        assert again.result()[0] == text
        for p, f in zip(PROMPTS[1:5], others):
            alone = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                   max_tokens=60, temperature=0).choices[0].message.content
            assert f.result()[0] == alone
    if server.kind == "eagle":
        metrics = server.metrics()
        assert metrics["serve_drafts_total"] > 0 and metrics['serve_accepted_tokens_by_position_total{position="2"}'] > 0
        assert plain.model_extra["timings"]["accepted_length"] > 1


def test_completions_raw(server, tiny):
    """/v1/completions continues the raw prompt as generate.py --raw does; streamed equals plain."""
    client = server.client()
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=30, temperature=0)
    text = plain.choices[0].text
    assert plain.usage.completion_tokens == 30 and plain.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=30, temperature=0, stream=True) if c.choices)
    assert streamed == text
    assert generate_py(tiny[0], "Once upon a time", 30, "--raw") == "Once upon a time" + text


def test_stop_string_spanning_tokens_is_never_sent(server):
    """A stop string made of the end of one token and the start of the next (with EAGLE: inside one cycle's block)
    ends the answer before it; it is never streamed, and usage counts the tokens up to it."""
    client = server.client()
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=40, temperature=0)
    full = client.chat.completions.create(**ask).choices[0].message.content
    from tokenizer import Tokenizer
    tokenizer = Tokenizer.load(REPO / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct")
    ids = tokenizer.encode(full)
    for k in range(3, len(ids) - 2):  # a boundary with two characters each side, first seen there
        b = len(tokenizer.decode(ids[:k]))
        stop = full[b - 2:b + 2]
        if len(stop) == 4 and full.find(stop) == b - 2 and tokenizer.decode(ids[:k]) == full[:b]:
            break
    else:
        pytest.skip("no token boundary fit for the test in this answer")
    plain = client.chat.completions.create(stop=[stop, "never-seen-stop"], **ask)
    assert plain.choices[0].message.content == full[:b - 2] and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == k
    streamed, chunks = stream_chat(client, stop=stop, **ask)
    assert streamed == full[:b - 2] and all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_same_seed_same_text_at_temperature_one(server):
    client = server.client()
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=30, temperature=1.0)
    first = client.chat.completions.create(seed=7, **ask).choices[0].message.content
    assert client.chat.completions.create(seed=7, **ask).choices[0].message.content == first
    assert stream_chat(client, seed=7, **ask)[0] == first
    others = {client.chat.completions.create(seed=s, **ask).choices[0].message.content for s in (8, 9)}
    assert others != {first}


ERRORS = [  # (body or raw bytes, content type, status, param)
    (b"{not json", "application/json", 400, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, "text/plain", 400, None),
    ({"messages": "hi"}, None, 400, "messages"),
    ({"messages": []}, None, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, None, 400, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, None, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, None, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, None, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, None, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, None, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, None, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, None, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ({"messages": [{"role": "user", "content": "hi " * 3000}], "stream": True}, None, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, None, 404, "model"),
]


def test_errors_answer_in_openai_shape_and_the_next_request_works(server):
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for body, content_type, status, param in ERRORS:
        got, answer = server.post("/v1/chat/completions", body, content_type or "application/json")
        assert got == status, (body, answer)
        error = answer["error"]
        assert error["message"] and error["type"] and error["param"] == param, (body, error)
        got, answer = server.post("/v1/chat/completions", ok)
        assert got == 200 and answer["usage"]["completion_tokens"] == 3
    assert server.get("/nowhere")[0] == 404
    assert server.post("/v1/completions", {"prompt": ""})[0] == 400
    assert server.metrics()['serve_requests_total{outcome="rejected"}'] >= len(ERRORS)


def read_first_chunk(server, body) -> http.client.HTTPConnection:
    """A streaming request whose first content chunk has been read; the connection is left open."""
    c = server.connection()
    c.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    while '"content": "' not in (line := r.readline().decode()) or '"content": ""' in line:
        pass
    return c, r


def test_abandoned_streams_free_their_rows(server):
    """50 streams dropped by their clients mid-stream leave no live row, and the next request is answered."""
    body = {"messages": [{"role": "user", "content": PROMPTS[4]}], "max_tokens": 1500, "temperature": 0}
    for _ in range(50):
        c, _ = read_first_chunk(server, body)
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
    deadline = time.time() + 30
    while server.metrics()["serve_rows_live"] > 0 and time.time() < deadline:
        time.sleep(0.1)
    metrics = server.metrics()
    assert metrics["serve_rows_live"] == 0 and metrics["serve_queue_length"] == 0
    assert metrics['serve_requests_total{outcome="cancelled"}'] >= 50
    start = time.time()
    assert server.post("/v1/chat/completions", {**body, "max_tokens": 5})[1]["usage"]["completion_tokens"] == 5
    assert time.time() - start < 30  # not stuck behind 50 abandoned answers (1500 tokens each)


def test_max_batch_two_answers_six_and_a_full_queue_is_503(tiny):
    """--max_batch 2 --max_queue 4: six concurrent streams are all answered; a seventh meanwhile gets 503."""
    s = Server("--checkpoint", str(tiny[0]), "--max_batch", "2", "--max_queue", "4")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600, "temperature": 0}
        opened = []
        for p in PROMPTS:
            c = s.connection()
            c.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True,
                      "messages": [{"role": "user", "content": p}]}), headers={"Content-Type": "application/json"})
            opened.append(c)
        responses = [c.getresponse() for c in opened]
        assert all(r.status == 200 for r in responses)
        status, answer = s.post("/v1/chat/completions", body)
        assert status == 503 and answer["error"]["code"] == "queue_full"
        start = time.time()
        assert s.get("/health")[0] == 200 and time.time() - start < 5  # HTTP answers while the engine runs
        bodies = [r.read().decode() for r in responses]
        for text in bodies:
            events = [line for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]
        assert ": ping" in bodies[-1]  # the last waited in the queue: SSE comments kept its connection alive
        assert s.post("/v1/chat/completions", {**body, "max_tokens": 2})[0] == 200
    finally:
        s.stop()


def test_api_key_and_cli_errors(tiny, tmp_path):
    s = Server("--checkpoint", str(tiny[0]), "--api_key", "sekrit")
    try:
        status, answer = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        model = s.client(api_key="sekrit").models.list().data[0].id
        reply = s.client(api_key="sekrit").chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert s.get("/health")[0] == 200 and "<title>" in s.get("/")[1]
    finally:
        s.stop()
    for flags, words in ((["--max_batch", "0"], "--max_batch"), (["--top_p", "2"], "--top_p"),
                         (["--checkpoint", str(tmp_path / "none")], "not found")):
        out = subprocess.run([sys.executable, "serve.py", "--port", str(free_port()), *flags], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().count("\n") == 0, out.stderr


def test_default_model_end_of_turn_with_eagle(default_checkpoint):
    """The default model with its shipped head: an answer that ends its turn has finish_reason stop, usage counting
    the end-of-turn token, and generate.py's text (fp32, greedy); /health says 503 before it is ready."""
    s = Server("--eagle", "--tree", "chain-2", "--max_batch", "2", wait=False)
    try:
        seen = []
        while 200 not in seen:
            try:
                seen.append(s.get("/health")[0])
            except OSError:
                assert s.proc.poll() is None, s.proc.stderr.read()
            time.sleep(0.02)
        assert seen[0] == 503 and set(seen) == {503, 200}, seen  # loading, then ready
        prompt = "What is the capital of France? Answer in one sentence."
        client = s.client()
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=100,
                                               messages=[{"role": "user", "content": prompt}])
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 100
        assert text == generate_py(default_checkpoint, prompt, 100, "--eagle", "--tree", "chain-2")
        from tokenizer import Tokenizer
        tokenizer = Tokenizer.load(default_checkpoint.parent)
        assert reply.usage.completion_tokens == len(tokenizer.encode(text)) + 1  # + the end-of-turn token
        assert reply.usage.prompt_tokens == len(tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    finally:
        s.stop()


def test_chat_page_in_a_headless_browser(tiny, tmp_path):
    """The page at /: with a system prompt, type a prompt, the streamed answer appears with its stats, equal to the
    API's answer to the same messages; a second turn; a long third answer stopped by the stop button (its row freed);
    a screenshot (SERVE_SCREENSHOT=path keeps it)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver = chromium_driver()
    if driver is None:
        pytest.skip("no chromium / chromedriver here: apt-get install chromium chromium-driver (.ci/run does)")
    s = Server("--checkpoint", str(tiny[0]), "--eagle", "--eagle_head", str(tiny[1]), "--tree", "chain-2")
    try:
        model = s.client().models.list().data[0].id
        driver.get(s.base + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "model").text)
        driver.find_element(By.ID, "system").send_keys("Be brief.")
        driver.find_element(By.ID, "max_tokens").send_keys("40")

        def send(prompt, turn):
            driver.find_element(By.ID, "prompt").send_keys(prompt)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == turn + 1)
        for turn, prompt in enumerate(PROMPTS[:2]):
            send(prompt, turn)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']")) == turn + 1)
        answers = [a.get_attribute("textContent") for a in driver.find_elements(By.CSS_SELECTOR, ".assistant")]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
        first = s.client().chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
        assert answers[0] == first.choices[0].message.content and answers[1]
        stats = driver.find_elements(By.CSS_SELECTOR, ".stats")
        assert len(stats) == 2 and re.search(r"40 tokens .* tokens/s .* accepted length \d", stats[0].text), stats[0].text
        path = Path(os.environ.get("SERVE_SCREENSHOT", tmp_path / "chat.png"))
        assert driver.save_screenshot(str(path)) and path.stat().st_size > 1000

        box = driver.find_element(By.ID, "max_tokens")  # a long answer, stopped once it has begun
        box.clear()
        box.send_keys("1900")
        send(PROMPTS[2], 2)
        third = driver.find_elements(By.CSS_SELECTOR, ".assistant")[2]
        wait.until(lambda d: third.get_attribute("textContent"))
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: third.get_attribute("data-done") == "1")
        assert "stopped" in driver.find_elements(By.CSS_SELECTOR, ".stats")[2].text
        deadline = time.time() + 10
        while s.metrics()["serve_rows_live"] > 0 and time.time() < deadline:
            time.sleep(0.1)
        assert s.metrics()["serve_rows_live"] == 0 and s.metrics()['serve_requests_total{outcome="cancelled"}'] == 1
    finally:
        driver.quit()
        s.stop()


def test_serve_benchmark_quick(tmp_path):
    """scripts/benchmark_serve.py --quick: servers at N = 1 and 2 clients, vanilla and EAGLE, every request counted
    (the screenshot of the page where a browser is installed)."""
    from scripts.benchmark_serve import main
    out = tmp_path / "out"
    main(["--quick", "--concurrency", "1", "2", "--out", str(out)] + (["--screenshot"] if shutil.which("chromedriver")
                                                                       else []))
    result = json.loads((out / "benchmark.json").read_text())
    rows = {(r["method"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(m, n) for m in ("vanilla", "eagle") for n in (1, 2)}
    assert all(r["requests"] == 4 and r["tokens"] == 4 * 16 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["eagle", 1]["accepted_length"] > 1 and rows["vanilla", 1]["accepted_length"] is None
    assert "| eagle | 2 |" in (out / "benchmark.md").read_text()
    assert not shutil.which("chromedriver") or (out / "chat.png").stat().st_size > 1000
