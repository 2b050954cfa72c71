"""`fibquant eval decode-speed`: time to first token (one-shot and chunked prefill with a fresh cache), decode
ms/token, cache bytes and peak memory per KV cache (argument parsing only)."""
from __future__ import annotations

import argparse

from ._common import (add_list_argument, add_model_argument, add_out_argument, add_specs_argument, add_text_argument,
                      apply_threads, run_experiment)

TIMING_THREADS = 1  # --threads default of this command (not half the cores: timings are per thread)


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser(
        "decode-speed", help="time to first token, decode speed and memory: DynamicCache vs CompressedCache vs "
                      "QuantizedCache")
    add_speed_arguments(parser)
    parser.set_defaults(func=run_speed_command)


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    from fibquant.eval.decode_speed.config import DEFAULT_CACHES, PARTS  # torch-free at import

    add_list_argument(parser, "--contexts", default=[1024, 2048, 4096, 8192],
                      help="context lengths in tokens (cut to leave room for the decoded tokens)")
    add_list_argument(parser, "--parts", type=str, default=list(PARTS), metavar="PART",
                      help="what to measure: ttft (fresh cache, whole prompt in one forward), chunked (the prompt "
                           "in --chunk-tokens chunks), decode (shared float prefill, then greedy steps); "
                           f"default {','.join(PARTS)}")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prompt chunk of the chunked TTFT")
    parser.add_argument("--prefill-repeats", type=int, default=1,
                        help="fresh timed prefills per cache, context and TTFT part (the median is reported)")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="interleaved rounds of greedy decode steps (one timed step per cache each)")
    parser.add_argument("--memory-steps", type=int, default=16,
                        help="untimed decode steps per cache after the rounds, one cache at a time, for its peak "
                             "memory")
    add_specs_argument(parser, default=list(DEFAULT_CACHES),
                       help="caches to compare, in the cache-spec grammar (fp = DynamicCache, always runs): "
                            "ours built from a bit count (fibquant:b=4, turboquant:b=2, int:b=4), with @decode for "
                            "the decode-the-whole-cache path; transformers' QuantizedCache as quanto:b=4, hqq:b=2 "
                            f"(default: {' '.join(DEFAULT_CACHES)})")
    add_text_argument(parser, help="novel to take the contexts from")
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--recent-tokens", type=int, default=32)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each cache")
    add_model_argument(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (model and caches on the GPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2-135M's architecture with random weights and random token ids (speed only; "
                             "for machines that cannot load the model file)")
    add_out_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"torch (and numba) CPU threads for the timed run (default {TIMING_THREADS}, unlike "
                             "the other commands: timings per thread compare across machines and loads)")


def run_speed_command(args: argparse.Namespace) -> int:
    from fibquant.eval.decode_speed.config import DecodeSpeedConfig
    from fibquant.kv.model import load_model

    if args.threads is None:
        args.threads = TIMING_THREADS
    apply_threads(args)  # validates (--threads >= 1) before anything loads
    config = DecodeSpeedConfig(contexts=tuple(args.contexts), decode_tokens=args.decode_tokens,
                               memory_steps=args.memory_steps,
                               caches=tuple(args.caches), text=args.text, sink_tokens=args.sink_tokens,
                               recent_tokens=args.recent_tokens, warmup=not args.no_warmup, device=args.device,
                               random_weights=args.random_weights, parts=tuple(args.parts),
                               chunk_tokens=args.chunk_tokens, prefill_repeats=args.prefill_repeats,
                               threads=args.threads)
    if args.random_weights or args.model is None:
        model_and_tokenizer = None  # load_benchmark_model(config) decides
    else:
        model, tokenizer = load_model(args.model)
        model_and_tokenizer = (model.to(args.device), tokenizer)
    payload = run_experiment("decode-speed", config, args.out, model_and_tokenizer=model_and_tokenizer,
                             progress=not args.no_progress)
    print(f"({payload['seconds']:.0f} s)")
    return 0
