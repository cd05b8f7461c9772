"""serve.py under load: N clients at once, each sending MT-bench first turns through the `openai` client.

    python scripts/benchmark_serve.py                      # N = 1 2 4 8, vanilla and EAGLE (--tree auto), compiled
    python scripts/benchmark_serve.py --quick              # tiny random model and head, eager, seconds (tests)

Protocol: per (method, N) a fresh `python serve.py --max_batch N` (EAGLE: --eagle --tree auto, the tree predicted
fastest for N rows) with --server_flags, ready when /health says so, warmed up by one request, then N client
threads take the prompts from one queue (greedy, --max_tokens each, streamed with usage). Per configuration:
generated tokens/s over the whole pass (all completion tokens / wall time), time to first token and the time
per output token after it (each request's (last - first chunk) / (tokens - 1)), p50 and p99 over the requests,
and EAGLE's accepted length (tokens per cycle) pooled over the requests' timings.

Writes <out>/benchmark.json and benchmark.md (default out: results/<date>-<machine>-serve).
"""
import argparse
import json
import queue
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from scripts.bench_common import (build_quick_checkpoint, chromium_driver, default_out, git_state,  # noqa: E402
                                  load_dataset, machine_info, repo_relative, select_questions)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8], help="clients at once (N)")
    p.add_argument("--methods", nargs="+", choices=["vanilla", "eagle"], default=["vanilla", "eagle"])
    p.add_argument("--limit", type=int, help="MT-bench first turns (default 20; --quick 4)")
    p.add_argument("--max_tokens", type=int, help="per request (default 64; --quick 16)")
    p.add_argument("--server_flags", default="--compile", help="more serve.py flags (default: --compile)")
    p.add_argument("--threads", type=int, default=1, help="serve.py --threads")
    p.add_argument("--out", type=Path, help="output folder (default: results/<date>-<machine>-serve)")
    p.add_argument("--quick", action="store_true", help="tiny random model and head, eager")
    p.add_argument("--screenshot", action="store_true", help="also the chat page answering the first prompt (EAGLE), "
                   "in headless chromium: <out>/chat.png")
    args = p.parse_args(argv)
    args.limit = args.limit or (4 if args.quick else 20)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    if args.quick:
        args.server_flags = ""
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list, log: Path):
    """(process, base URL) of a serve.py that answers /health."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), *flags], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py {' '.join(flags)} exited: {log.read_text().strip()[-300:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat request: its chunk times, usage and timings."""
    start, chunks, usage, timings = time.perf_counter(), [], None, None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.perf_counter())
        if chunk.usage is not None:
            usage, timings = chunk.usage, (chunk.model_extra or {}).get("timings")
    n = usage.completion_tokens
    return {"ttft_s": chunks[0] - start if chunks else None, "tokens": n,
            "tpot_s": (chunks[-1] - chunks[0]) / (n - 1) if len(chunks) > 1 and n > 1 else None,
            "cycles": (timings or {}).get("cycles"), "accepted": (timings or {}).get("draft_n_accepted")}


def run_clients(base: str, prompts: list, n: int, max_tokens: int) -> tuple:
    """All prompts through n client threads at once: (per-request results, wall seconds)."""
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    work, results, errors = queue.Queue(), [], []
    for p in prompts:
        work.put(p)

    def client_loop():
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            try:
                results.append(one_request(client, model, prompt, max_tokens))
            except Exception as e:  # reported after the pass
                errors.append(repr(e))
    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]}")
    return results, time.perf_counter() - start


def percentile(values: list, q: float):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


def summarize(method: str, n: int, results: list, wall: float) -> dict:
    cycles = sum(r["cycles"] or 0 for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"method": method, "concurrency": n, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": percentile([r["ttft_s"] for r in results], 0.5),
            "ttft_p99_s": percentile([r["ttft_s"] for r in results], 0.99),
            "tpot_p50_ms": 1000 * (percentile([r["tpot_s"] for r in results], 0.5) or 0),
            "tpot_p99_ms": 1000 * (percentile([r["tpot_s"] for r in results], 0.99) or 0),
            "accepted_length": round(1 + sum(r["accepted"] or 0 for r in results) / cycles, 3) if cycles else None}


def screenshot(flags: list, prompt: str, max_tokens: int, path: Path, log: Path):
    """The chat page of a server started with flags, after it answered prompt (at most max_tokens), saved as a PNG
    (headless chromium)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium_driver("900,900")
    if driver is None:
        raise RuntimeError("--screenshot needs chromium and chromedriver: apt-get install chromium chromium-driver")
    proc, base = start_server(flags, log)
    try:
        driver.get(base + "/")
        wait = WebDriverWait(driver, 600)
        wait.until(lambda d: d.find_element(By.ID, "model").text)
        driver.find_element(By.ID, "max_tokens").send_keys(str(max_tokens))
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']"))
        driver.save_screenshot(str(path))
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(30)


def markdown(result: dict) -> str:
    lines = [f"# serve.py under load ({result['machine']['processor']}, {result['machine']['isa']})", "",
             f"`{result['command']}` at {result['git']['commit']}; {result['prompts']} MT-bench first turns, "
             f"{result['max_tokens']} tokens at most, greedy; serve.py {result['server_flags']}", "",
             "| method | N | tokens/s | TTFT p50 / p99 (s) | time per output token p50 / p99 (ms) | accepted length |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                     f"{r['accepted_length'] or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import Tokenizer, ensure_default_model
    info = machine_info("cpu")
    out = args.out or default_out(info, args.quick, "-serve")
    out.mkdir(parents=True, exist_ok=True)
    model_flags = shlex.split(args.server_flags) + ["--threads", str(args.threads)]
    head_flags = []
    if args.quick:
        checkpoint, head = build_quick_checkpoint(out / "tiny")
        model_flags += ["--checkpoint", str(checkpoint)]
        head_flags = ["--eagle_head", str(head)]
    Tokenizer.load(ensure_default_model().parent)  # the default model converted before any server starts
    prompts = [item.turns[0] for item in select_questions(load_dataset("mtbench"), args.limit, None)]
    command = " ".join(["python", repo_relative(Path(sys.argv[0]))] + [shlex.quote(a) for a in (argv or sys.argv[1:])])
    result = {"command": command, "git": git_state(), "machine": info, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "server_flags": args.server_flags, "rows": []}
    for method in args.methods:
        for n in args.concurrency:
            flags = model_flags + ["--max_batch", str(n)]
            if method == "eagle":
                flags += ["--eagle", "--tree", "chain-2" if args.quick else "auto"] + head_flags
            start = time.perf_counter()
            proc, base = start_server(flags, out / f"serve-{method}-{n}.log")
            try:
                ready = time.perf_counter() - start
                run_clients(base, prompts[:1], 1, 8)  # warm-up
                results, wall = run_clients(base, prompts, n, args.max_tokens)
            finally:
                proc.terminate()
                proc.wait(30)
            row = {**summarize(method, n, results, wall), "ready_s": round(ready, 1)}
            result["rows"].append(row)
            print(f"{method} N={n}: {row['tokens_per_s']:.1f} tokens/s, TTFT p50 {row['ttft_p50_s']:.2f} s"
                  + (f", accepted length {row['accepted_length']}" if row["accepted_length"] else ""), file=sys.stderr)
            (out / "benchmark.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "benchmark.md").write_text(markdown(result))
    if args.screenshot:
        screenshot(model_flags + ["--max_batch", "1", "--eagle", "--tree", "chain-2" if args.quick else "auto"]
                   + head_flags, prompts[0], 4 * args.max_tokens, out / "chat.png", out / "serve-screenshot.log")
    print(markdown(result), file=sys.stderr)
    print(f"wrote benchmark.json and benchmark.md to {repo_relative(out)}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
