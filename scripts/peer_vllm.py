"""vLLM's engine as a peer: runs one job of scripts/benchmark_peers.py inside the peers' virtual environment.

Imports nothing of this repository (vLLM's environment is not ours): it reads a job (JSON) naming a Hugging
Face directory (scripts/export_hf.py), the dtype, an optional EAGLE head with k draft tokens, and prompts as
token ids; it keeps at most N requests in flight for each concurrency N (continuous batching: a finished
request's place goes to the next prompt at once) and writes every request's token ids, the wall time, each
long prompt's time to first token and vLLM's speculative-decoding counters as JSON.

    .venv-peers/bin/python scripts/peer_vllm.py JOB.json RESULT.json
"""
import json
import os
import sys
import time


def engine_args(job: dict) -> dict:
    args = dict(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=0,
                max_num_seqs=max(job["concurrency"]), max_model_len=job["max_model_len"],
                enable_prefix_caching=False,  # every method here prefills every prompt in full
                disable_log_stats=False)  # LLM turns its stats off by default: no speculative-decoding counters
    if job.get("k"):
        args["speculative_config"] = {"method": "eagle", "model": job["head"], "num_speculative_tokens": job["k"]}
    return args


def run_requests(engine, prompts: list, concurrency: int, params, tag: str) -> tuple:
    """Run the prompts with at most `concurrency` in flight; returns ([token ids per prompt], wall_s,
    [seconds from a request's start to its first token])."""
    from vllm.inputs import TokensPrompt

    outs, started, first = [None] * len(prompts), {}, [None] * len(prompts)
    pending = list(range(len(prompts)))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) - sum(o is not None for o in outs) < concurrency:
            i = pending.pop(0)
            started[i] = time.perf_counter()
            engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompts[i]), params)
        for request in engine.step():
            i = int(request.request_id.rsplit("-", 1)[1])
            if first[i] is None and request.outputs and request.outputs[0].token_ids:
                first[i] = time.perf_counter() - started[i]
            if request.finished:
                outs[i] = list(request.outputs[0].token_ids)
    return outs, time.perf_counter() - start, first


def spec_counters(llm) -> dict:
    """vLLM's counters of drafts, draft tokens and accepted tokens (empty where it keeps none)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # an engine without metrics: the counters are left out, not guessed
        return {}
    counters = {}
    for m in metrics:
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            counters[m.name.removeprefix("vllm:spec_decode_")] = m.value
    return counters


def main():
    job_path, result_path = sys.argv[1:3]
    job = json.loads(open(job_path).read())
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(job))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stop_ids"],
                            detokenize=False, ignore_eos=job.get("ignore_eos", False))
    warm = time.perf_counter()
    for n in sorted(set(job["concurrency"])):  # compile and warm every batch shape before timing
        run_requests(engine, job["prompts"][: 2 * n], n, SamplingParams(temperature=0.0, max_tokens=16,
                                                                         detokenize=False), f"warm{n}")
    result = {"warmup_s": time.perf_counter() - warm, "engine": engine_args(job), "runs": [],
              "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    for repeat in range(job["repeats"]):
        for n in job["concurrency"]:
            before = spec_counters(llm)
            outs, wall, _ = run_requests(engine, job["prompts"], n, params, f"r{repeat}c{n}")
            after = spec_counters(llm)
            result["runs"].append({"repeat": repeat, "concurrency": n, "wall_s": wall, "outs": outs,
                                   "spec_decode": {k: after[k] - before.get(k, 0) for k in after}})
    if job.get("long_prompts"):
        outs, wall, first = run_requests(engine, job["long_prompts"], 1, SamplingParams(
            temperature=0.0, max_tokens=1, detokenize=False), "long")
        result["ttft_s"] = first
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    main()
