"""`fibquant cache save|info|generate`: a compressed KV cache on disk (argument parsing only)."""
from __future__ import annotations

import argparse
import sys

from .. import _json as strict_json
from ._common import (add_list_argument, add_model_argument, add_out_argument, add_text_argument,
                      add_threads_argument, apply_threads, check_folder_writable, check_output, check_positive,
                      recovery_notices)


def _prompt_ids(args, tokenizer):
    import torch

    if args.prompt is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids[0]
    else:
        from fibquant.eval.kv_report import text_tokens

        ids = text_tokens(tokenizer, args.text, args.tokens).to(torch.long)
    if ids.shape[0] == 0:
        raise ValueError("the prompt gives no tokens")
    return ids


def _check_save(args) -> None:
    """Every argument of `cache save` checked before the model loads."""
    from fibquant.archive.writer import WriterLock

    if (args.prompt is None) == (args.text is None):
        raise ValueError("give the prompt with --prompt STRING or --text NOVEL (with --tokens N), not both")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty: give the text to start from")
    check_positive(max_new_tokens=args.max_new_tokens, checkpoint_every=args.checkpoint_every, tokens=args.tokens)
    if args.sink_tokens < 0 or args.recent_tokens < 0:
        raise ValueError("--sink-tokens and --recent-tokens must be >= 0")
    check_output(args.output, args.overwrite)
    WriterLock.acquire(args.output).release()  # another writer at work: refused before the model loads


def _save(args) -> int:
    from fibquant.codecs.registry import parse_codec_spec
    from fibquant.kv.model import load_model
    from fibquant.kv.persist.generate import generate_persistent
    from fibquant.kv.plan import Centred

    _check_save(args)
    method = parse_codec_spec(args.method)
    apply_threads(args)
    model, tokenizer = load_model(args.model)
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    codec = method.build(head_dim)
    ids = _prompt_ids(args, tokenizer)
    out = generate_persistent(model, ids, args.output, codec, codec, sink_tokens=args.sink_tokens,
                              recent_tokens=args.recent_tokens, max_new_tokens=args.max_new_tokens,
                              overwrite=args.overwrite, checkpoint_every=args.checkpoint_every,
                              layer_plan=Centred() if args.centre else None)
    print(tokenizer.decode(out[0, ids.shape[0]:]))
    return _info_of(args.output, verify=False)


def _info_of(path, verify: bool = True) -> int:
    from fibquant.kv.persist.store import PersistentCache

    with recovery_notices(), PersistentCache.open(path) as store:
        info = store.info()
        if verify:
            info["verified_blocks"] = store.verify()
        print(strict_json.dumps(info, indent=1))
    return 0


def _info(args) -> int:
    return _info_of(args.cache, verify=args.verify)


def _generate(args) -> int:
    from pathlib import Path

    from fibquant.archive.writer import WriterLock
    from fibquant.kv.persist.store import PersistentCache

    check_positive(max_new_tokens=args.max_new_tokens, checkpoint_every=args.checkpoint_every)
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty: leave it out to continue the saved text")
    with recovery_notices():
        with PersistentCache.open(args.cache) as store:  # the folder and its manifest, before the model loads
            stored = len(store.tokens)
        check_folder_writable(Path(args.cache))
        WriterLock.acquire(args.cache).release()  # another writer at work: refused before the model loads
        return _resume(args, stored)


def _resume(args, stored: int) -> int:
    from fibquant.kv.model import load_model
    from fibquant.kv.persist.generate import resume_generate

    apply_threads(args)
    model, tokenizer = load_model(args.model)
    extra = None if args.prompt is None else tokenizer(args.prompt, add_special_tokens=False,
                                                       return_tensors="pt").input_ids[0]
    before = stored + (0 if extra is None else extra.shape[0])
    out = resume_generate(model, args.cache, extra, max_new_tokens=args.max_new_tokens,
                          checkpoint_every=args.checkpoint_every)
    print(tokenizer.decode(out[0, before:]))
    print(f"cache: {args.cache}, {out.shape[1]} token ids", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("cache", help="save, inspect and resume a compressed KV cache on disk")
    sub = parser.add_subparsers(dest="cache_command", required=True)
    save = sub.add_parser("save", help="generate from a prompt with a compressed cache written to OUTPUT")
    save.add_argument("output")
    save.add_argument("--prompt", default=None)
    save.add_argument("--text", default=None, help="use the first --tokens tokens of this novel as the prompt")
    save.add_argument("--tokens", type=int, default=512)
    save.add_argument("--method", default="fibquant:b=2", help="codec spec (fibquant:b=2, turboquant:b=3, int:b=4)")
    save.add_argument("--sink-tokens", type=int, default=4)
    save.add_argument("--recent-tokens", type=int, default=32)
    save.add_argument("--max-new-tokens", type=int, default=32)
    save.add_argument("--checkpoint-every", type=int, default=64)
    save.add_argument("--centre", action="store_true",
                      help="quantise keys/values minus their per-(layer, head) mean (saved with the cache)")
    add_model_argument(save)
    save.add_argument("--overwrite", action="store_true")
    add_threads_argument(save)
    save.set_defaults(func=_save)
    info = sub.add_parser("info", help="manifest, sizes and recovered length of a saved cache")
    info.add_argument("cache")
    info.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                      help="check the checksum of every stored block (default; --no-verify: headers only)")
    info.set_defaults(func=_info)
    generate = sub.add_parser("generate", help="continue generating from a saved cache (appends to it)")
    generate.add_argument("cache")
    generate.add_argument("--prompt", default=None, help="text appended before generating (e.g. a new turn)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--checkpoint-every", type=int, default=64)
    add_model_argument(generate)
    add_threads_argument(generate)
    generate.set_defaults(func=_generate)


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser("archive-kv", help="saved-cache benchmarks: prefix reuse TTFT, code search")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    add_text_argument(parser)
    parser.add_argument("--method", default="fibquant:b=2")
    parser.add_argument("--repeats", type=int, default=3)
    add_list_argument(parser, "--parts", type=str, default=["ttft", "search", "store", "study"], metavar="PART",
                      help="subset of ttft search store study (default: all)")
    add_list_argument(parser, "--search-sizes", default=[100_000, 1_000_000],
                      help="stored tokens of the search-at-scale part (default: 100000 1000000)")
    parser.add_argument("--study-windows", type=int, default=2, help="windows of --study-context tokens of emma")
    parser.add_argument("--study-context", type=int, default=1024)
    parser.add_argument("--study-calibration-tokens", type=int, default=8192,
                        help="tokens of persuasion the RVQ codebooks are fitted on (default 8192)")
    add_list_argument(parser, "--study-groups", type=str, default=[], metavar="GROUP",
                      help="only these study groups: universal rvq-pooled rvq-per-head one-role hybrid (default: all)")
    parser.add_argument("--name", default="archive_kv", help="report file name (results/NAME.json|.png)")
    add_out_argument(parser)
    add_threads_argument(parser)
    parser.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from fibquant.eval.archive.kv import ArchiveKVConfig, main_archive_kv

    config = ArchiveKVConfig(text=args.text, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                             method=args.method, repeats=args.repeats)
    from fibquant.eval.archive.study import StudyConfig

    study = StudyConfig(windows=args.study_windows, context=args.study_context,
                        calibration_tokens=args.study_calibration_tokens, groups=tuple(g.replace("-", " ") for g in args.study_groups))
    parts, sizes = tuple(args.parts), tuple(args.search_sizes)
    from pathlib import Path

    from fibquant.paths import results_root

    check_folder_writable(Path(args.out) if args.out else results_root(), create=True)  # before the long run
    apply_threads(args)
    main_archive_kv(config, args.out, parts=parts, study=study, search_sizes=sizes, name=args.name)
    return 0
