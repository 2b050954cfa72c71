"""Run a vLLM engine in a child process, with or without the FibQuant cache, and return plain data.

Why a child process: the plugin registers its backend when vLLM starts, once per process, so a
bf16 engine and a FibQuant engine (or two rates) cannot share one. Tests and the serving benchmark
call `run_task`; the child runs `python -m fibquant.integrations.vllm.engine` on a JSON task.

Tasks (JSON in, JSON out; every result also has `kv_capacity_tokens`, `load_s` and `task_s`):
    {"task": "greedy", "prompts": [str], "max_tokens": int}
        -> {"token_ids": [[int]], "texts": [str], "margins": [[float]]} (margins: top-1 minus top-2
           log-probability per step)
    {"task": "prompt_logprobs", "token_ids": [int]}
        -> {"logprobs": [float]}  (log p of tokens 1..n-1 given their prefix)
    {"task": "prompt_logprobs", "spans": [[int]]}
        -> {"logprobs": [[float]]}  (the same per span, each a request of its own, one after another)
    {"task": "throughput", "prompt_token_ids": [[int]], "max_tokens": int}
        -> {"seconds", "ttft_s", "prefill_s", "decode_tokens_per_s", "generated", "prompt_tokens",
            "decode_attention_s", "decode_attention_calls"}  (the attention backend's forward + cache
           write of the measured batch's decode-only steps: seconds in all, and layer calls)
    {"task": "serve", "prompt_token_ids": [[int]], "max_tokens": int}
        -> {"seconds", "cpu_s", "latencies_s": [float], "generated", "prompt_tokens", "preemptions",
           "steps"}: every request submitted at once (a burst) and served to the end; latency = its
           finish time; cpu_s = the process's CPU seconds over the burst (what a shared machine's
           time-slicing does not inflate); steps = the engine's steps of the burst (`step_summary`)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from fibquant.integrations.vllm.config import (DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, ENV_VAR, RECENT_ENV_VAR,
                                               SINKS_ENV_VAR, VllmCacheConfig)

RESULT_MARK = "FIBQUANT_RESULT "


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is started with. `kv_cache_gib` is the KV budget (vLLM's kv_cache_memory_bytes,
    any fraction of a GiB); with a FibQuant cache the plugin's worker takes the exact-window side stores
    (`window_bytes`) off it (`budget`), so the pages and the window together fit the same budget as bf16's pages.
    `chunk_tokens` caps the tokens of one forward (chunked prefill), which is also what decides how
    many earlier tokens a prompt token sees through codes."""

    model_dir: str
    cache_spec: str | None = None
    max_model_len: int = 2048
    chunk_tokens: int = 2048
    kv_cache_gib: float = 1.0
    dtype: str = "bfloat16"
    max_num_seqs: int = 16
    kv_cache_dtype: str = "auto"  # vLLM's own cache dtypes (fp8, turboquant_*), with cache_spec None
    device: str = "cpu"           # "cuda": the budget goes through kv_cache_memory_bytes
    sink_tokens: int = DEFAULT_SINK_TOKENS  # exact first tokens of each sequence (FibQuant cache only)
    recent_tokens: int = DEFAULT_RECENT_TOKENS  # exact last tokens before each forward (FibQuant cache only)
    enable_prefix_caching: bool = False  # vLLM's prefix caching (full blocks shared between sequences)
    block_size: int | None = None        # vLLM's KV block size in tokens (None: vLLM's default)
    tensor_parallel_size: int = 1        # workers, each with its share of the KV heads (and its own pages)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.max_model_len < 2 or self.kv_cache_gib <= 0:
            raise ValueError(f"bad engine settings: {self}")
        if self.cache_spec and self.kv_cache_dtype != "auto":
            raise ValueError("a FibQuant cache_spec replaces the cache dtype: leave kv_cache_dtype='auto'")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


def run_task(settings: EngineSettings, task: dict, timeout: float = 1800.0, python: str | None = None) -> dict:
    """Start a child vLLM engine with `settings`, run `task`, return its JSON result.

    Raises RuntimeError with the child's last output lines when it fails.
    """
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if settings.cache_spec:
        env[ENV_VAR] = settings.cache_spec
        env[SINKS_ENV_VAR] = str(settings.sink_tokens)
        env[RECENT_ENV_VAR] = str(settings.recent_tokens)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes (whole GiB only)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    payload = json.dumps({"settings": asdict(settings), "task": task})
    done = subprocess.run([python or sys.executable, "-m", "fibquant.integrations.vllm.engine"], input=payload,
                          capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    raise RuntimeError(f"vLLM child exited with {done.returncode} and no result:\n{tail}")


def window_bytes(settings: EngineSettings) -> int:
    """Bytes of the exact-window side stores of a FibQuant engine at their bound (0 without one): every
    layer keeps (sinks + recent) keys and values per schedulable sequence (`window.ExactWindow`); what
    the worker takes off the budget (`budget.worker_split`), read here from the model's config.json."""
    if not settings.cache_spec:
        return 0
    with open(os.path.join(settings.model_dir, "config.json")) as handle:
        model = json.load(handle)
    model = model.get("text_config", model)
    heads = model["num_attention_heads"]
    head_dim = model.get("head_dim") or model["hidden_size"] // heads
    element = 4 if settings.dtype in ("float32", "float") else 2
    config = VllmCacheConfig.parse(settings.cache_spec, settings.sink_tokens, settings.recent_tokens)
    return config.window_bytes(head_dim, model.get("num_key_value_heads") or heads, model["num_hidden_layers"],
                               settings.max_num_seqs, element, settings.enable_prefix_caching)


def _engine(settings: EngineSettings):
    from vllm import LLM

    extra = {"kv_cache_memory_bytes": int(settings.kv_cache_gib * 2 ** 30)}  # the window comes out of it (`budget`)
    if settings.device == "cuda" and settings.cache_spec:
        extra["attention_backend"] = "CUSTOM"
    if settings.block_size is not None:
        extra["block_size"] = settings.block_size
    if settings.tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = settings.tensor_parallel_size
    return LLM(model=settings.model_dir, dtype=settings.dtype, enforce_eager=True,
               max_model_len=settings.max_model_len, enable_chunked_prefill=True,
               max_num_batched_tokens=settings.chunk_tokens, max_num_seqs=settings.max_num_seqs,
               enable_prefix_caching=settings.enable_prefix_caching, kv_cache_dtype=settings.kv_cache_dtype, seed=0, **extra)


def _capacity(llm) -> int:
    config = llm.llm_engine.vllm_config.cache_config
    return int(config.num_gpu_blocks or 0) * int(config.block_size)


def _greedy(llm, task: dict) -> dict:
    from vllm import SamplingParams

    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, logprobs=2)
    prompts = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in task["prompts"]]
    if task.get("one_by_one"):  # each prompt after the previous one finished (prefix caching: later hits)
        outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "margins": [[_margin(step) for step in o.outputs[0].logprobs] for o in outputs],
            "logprobs": [[step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outputs],
            "cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs]}


def _margin(step: dict) -> float:
    """log p(top 1) - log p(top 2) of one greedy step: how far the choice was from a tie."""
    values = sorted((entry.logprob for entry in step.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _prompt_logprobs(llm, task: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def one(ids: list[int]) -> list[float]:
        output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], ids[1:])]

    if "spans" in task:  # one engine for several spans (an engine start costs more than a 512-token span)
        return {"logprobs": [one(ids) for ids in task["spans"]]}
    return {"logprobs": one(task["token_ids"])}


_ATTENTION = {"seconds": 0.0, "calls": 0, "decode_tokens": 0}
_PREEMPTIONS = [0]
# per engine step: [requests scheduled, tokens scheduled, wall seconds, CPU seconds] from schedule to update
_STEPS: list[list] = []
_OPEN_STEPS: dict[int, tuple[float, float]] = {}


def step_summary(steps: list[list]) -> dict:
    """What the engine's steps say about batching. `steps`: [requests scheduled, tokens scheduled,
    wall seconds, CPU seconds] per step. A decode-only step schedules one token per request (no
    prompt chunk in it).

    Returns {"steps", "max_batch" (most requests in one step), "decode_steps", "decode_tokens",
    "decode_s", "decode_cpu_s", "decode_by_batch": {requests: [steps, wall s, CPU s]}} (keys of
    decode_by_batch are strings, as JSON has them)."""
    decode = [(n, wall, cpu) for n, tokens, wall, cpu in steps if 0 < n == tokens]
    by_batch: dict[str, list] = {}
    for n, wall, cpu in decode:
        entry = by_batch.setdefault(str(n), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += wall
        entry[2] += cpu
    return {"steps": len(steps), "max_batch": max((step[0] for step in steps), default=0),
            "decode_steps": len(decode), "decode_tokens": sum(n for n, _, _ in decode),
            "decode_s": sum(wall for _, wall, _ in decode), "decode_cpu_s": sum(cpu for _, _, cpu in decode),
            "decode_by_batch": by_batch}


def _attention_class(settings: EngineSettings):
    if settings.cache_spec:
        from fibquant.integrations.vllm.backend import FibQuantAttentionImpl

        return FibQuantAttentionImpl
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return CPUAttentionBackendImpl


def _instrument(settings: EngineSettings) -> None:
    """Time the attention backend's forward and cache write on decode-only steps (at most
    `_ATTENTION["decode_tokens"]` tokens), count the scheduler's preemptions, and record each engine
    step's requests, tokens and seconds (from the scheduler's schedule to its update) in `_STEPS`."""
    impl = _attention_class(settings)
    for name, counts in (("forward", True), ("do_kv_cache_update", False)):
        original = getattr(impl, name)

        def timed(self, layer, first, *args, __original=original, __counts=counts, **kwargs):
            start = time.perf_counter()
            out = __original(self, layer, first, *args, **kwargs)
            if 0 < first.shape[0] <= _ATTENTION["decode_tokens"]:
                _ATTENTION["seconds"] += time.perf_counter() - start
                _ATTENTION["calls"] += int(__counts)
            return out

        setattr(impl, name, timed)
    from vllm.v1.core.sched.scheduler import Scheduler

    preempt = Scheduler._preempt_request

    def counted(self, *args, **kwargs):
        _PREEMPTIONS[0] += 1
        return preempt(self, *args, **kwargs)

    Scheduler._preempt_request = counted
    schedule, update = Scheduler.schedule, Scheduler.update_from_output

    def opened(self, *args, **kwargs):
        start = time.perf_counter(), time.process_time()
        out = schedule(self, *args, **kwargs)
        _OPEN_STEPS[id(out)] = start
        return out

    def closed(self, scheduler_output, *args, **kwargs):
        result = update(self, scheduler_output, *args, **kwargs)
        start = _OPEN_STEPS.pop(id(scheduler_output), None)
        if start is not None and scheduler_output.total_num_scheduled_tokens > 0:
            _STEPS.append([len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens,
                           time.perf_counter() - start[0], time.process_time() - start[1]])
        return result

    Scheduler.schedule, Scheduler.update_from_output = opened, closed


def _serve(llm, task: dict) -> dict:
    """A burst: every prompt submitted at once, the engine stepped until all finish (after a warm-up
    of two requests); per request the time from submission to its last token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in task["prompt_token_ids"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=True)
    _PREEMPTIONS[0] = 0
    _STEPS.clear()
    start, cpu = time.perf_counter(), time.process_time()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"serve-{index}", prompt, params)
    finished, generated = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id not in finished:
                finished[output.request_id] = time.perf_counter() - start
                generated += len(output.outputs[0].token_ids)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_s": cpu, "latencies_s": sorted(finished.values()), "generated": generated,
            "prompt_tokens": sum(len(ids) for ids in task["prompt_token_ids"]), "preemptions": _PREEMPTIONS[0],
            "steps": step_summary(_STEPS)}


def warm_up(llm, prompts: list) -> None:
    """Run each shape `_throughput` times once, untimed, whatever the cache (bf16 or ours): one prompt
    (the time to first token) and the whole batch, each with a few decode steps. First calls of a shape
    pay one-off costs (numba specialises its kernels per batch and query shape; torch / oneDNN set up
    per-shape kernels; buffers are touched for the first time) that a timed region would count as
    serving time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for shape in (prompts[:1], prompts):
        llm.generate(shape, params, use_tqdm=False)


def _throughput(llm, task: dict) -> dict:
    """After a warm-up of both shapes (`warm_up`), the time to first token of one prompt,
    the batch's prefill alone (max_tokens=1), then the batch with `max_tokens` greedy tokens each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in task["prompt_token_ids"]]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    warm_up(llm, prompts)
    start = time.perf_counter()
    llm.generate(prompts[:1], one, use_tqdm=False)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - start
    params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=True)
    _ATTENTION.update(seconds=0.0, calls=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "ttft_s": ttft, "prefill_s": prefill, "generated": generated,
            "decode_tokens_per_s": (generated - len(prompts)) / max(seconds - prefill, 1e-9),
            "prompt_tokens": sum(len(ids) for ids in task["prompt_token_ids"]),
            "decode_attention_s": _ATTENTION["seconds"], "decode_attention_calls": _ATTENTION["calls"]}


TASKS = {"greedy": _greedy, "prompt_logprobs": _prompt_logprobs, "throughput": _throughput, "serve": _serve}


def _main() -> None:
    request = json.loads(sys.stdin.read())
    settings, task = EngineSettings(**request["settings"]), request["task"]
    if task.get("task") not in TASKS:
        raise ValueError(f"unknown task {task.get('task')!r}; expected one of {sorted(TASKS)}")
    if task["task"] in ("throughput", "serve"):
        _ATTENTION["decode_tokens"] = len(task["prompt_token_ids"])
        _instrument(settings)
    start = time.perf_counter()
    llm = _engine(settings)
    result = {"load_s": time.perf_counter() - start, "kv_capacity_tokens": _capacity(llm),
              "cache_spec": settings.cache_spec, "window_bytes": window_bytes(settings)}
    start = time.perf_counter()
    result.update(TASKS[task["task"]](llm, task))
    result["task_s"] = time.perf_counter() - start
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
