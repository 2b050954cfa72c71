"""`fibquant eval speed`: decode ms/token, cache bytes and peak memory per KV cache (argument parsing only)."""
from __future__ import annotations

import argparse

from ._common import (add_list_argument, add_model_argument, add_out_argument, add_specs_argument, add_text_argument,
                      add_threads_argument, apply_threads, run_experiment)


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser(
        "speed", help="decode speed and memory: DynamicCache vs CompressedCache vs QuantizedCache")
    add_speed_arguments(parser)
    parser.set_defaults(func=run_speed_command)


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    from fibquant.eval.decode_speed_config import DEFAULT_CACHES  # torch-free at import

    add_list_argument(parser, "--contexts", default=[1024, 2048, 4096, 8192],
                      help="context lengths in tokens (cut to leave room for the decoded tokens)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps per run")
    add_specs_argument(parser, "--caches", default=list(DEFAULT_CACHES),
                       help="caches to compare (DynamicCache always runs): dynamic, <codec family>B for the "
                            "registered codecs built from a bit count (fibquantB, turboquantB, intB), with -old "
                            "for the decode-the-whole-cache path, quantoB, hqqB "
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
    add_threads_argument(parser)


def run_speed_command(args: argparse.Namespace) -> int:
    from fibquant.eval.decode_speed_config import DecodeSpeedConfig
    from fibquant.kv.model import load_model

    config = DecodeSpeedConfig(contexts=tuple(args.contexts), decode_tokens=args.decode_tokens,
                               caches=tuple(args.caches), text=args.text, sink_tokens=args.sink_tokens,
                               recent_tokens=args.recent_tokens, warmup=not args.no_warmup, device=args.device,
                               random_weights=args.random_weights)
    apply_threads(args)
    if args.random_weights or args.model is None:
        model_and_tokenizer = None  # load_benchmark_model(config) decides
    else:
        model, tokenizer = load_model(args.model)
        model_and_tokenizer = (model.to(args.device), tokenizer)
    payload = run_experiment("speed", config, args.out, model_and_tokenizer=model_and_tokenizer,
                             progress=not args.no_progress)
    print(f"({payload['seconds']:.0f} s)")
    return 0
