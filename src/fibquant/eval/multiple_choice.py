"""Multiple-choice accuracy with the KV cache in the loop (experiment 4).

Scoring follows lm-eval's `multiple_choice` output type:
    acc       = [argmax_i  loglik(option_i | context)          == correct]
    acc_norm  = [argmax_i  loglik(option_i | context) / len_i  == correct]
with loglik the summed log-probability of the option's tokens and len_i the option's length
in characters (lm-eval's `acc_norm`). The context is the example's input with trailing
spaces moved to the continuation, continuation = " " + option; no BOS token is added
(lm-eval's default for causal LMs); no choices are listed in the prompt (HellaSwag style).

Protocol with a cache (so that a compressed cache is really read back):
    1. prefill: all context tokens but the last are run into a fresh cache from
       `cache_factory()` (DynamicCache for fp); with a CompressedCache every context token
       outside the exact window (first `sink_tokens`, last `recent_tokens`) is stored only as
       codes after this pass;
    2. score: [last context token] + option tokens[:-1] are run in a second pass attending to
       the cache; its logits give the log-probability of every option token.
The context is prefilled once and the cache repeated per option (`batch_repeat_interleave`), so
all options of an example are scored as one batch; shorter options
are right-padded, which cannot affect earlier positions under causal attention, and the padded
positions are left out of the sums. `context_tokens_compressed` counts, per example, the
context tokens the scoring pass read back from codes.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from fibquant.data.bigbench import MultipleChoiceExample
from fibquant.kv.model import cache_kwarg
from fibquant.eval.report import Experiment, figure, format_table
from fibquant.kv.attention.switch import attention_on_codes


@dataclass(frozen=True)
class ScoredOptions:
    """Log-likelihood of each option of one example, and what the cache held."""

    logliks: tuple[float, ...]
    context_tokens: int
    context_tokens_compressed: int


class OptionScorer(Protocol):
    def __call__(self, context: str, continuations: Sequence[str]) -> ScoredOptions: ...


def split_context(example: MultipleChoiceExample) -> tuple[str, list[str]]:
    """(context, continuations): trailing spaces of the input move to each continuation."""
    context = example.input.rstrip(" ")
    delimiter = example.input[len(context):] or " "
    return context, [delimiter + option for option in example.options]


def predictions(logliks: Sequence[float], options: Sequence[str]) -> tuple[int, int]:
    """(argmax loglik, argmax loglik / len(option) in characters), first index on ties."""
    if len(logliks) != len(options) or not options:
        raise ValueError(f"need one log-likelihood per option, got {len(logliks)} for {len(options)} options")
    if any(len(option) == 0 for option in options):
        raise ValueError("options must be non-empty strings (acc_norm divides by their length)")
    normalised = [ll / len(option) for ll, option in zip(logliks, options)]
    return (max(range(len(logliks)), key=logliks.__getitem__),
            max(range(len(normalised)), key=normalised.__getitem__))


def select_examples(examples: Sequence[MultipleChoiceExample], limit: int | None,
                    seed: int = 0) -> list[MultipleChoiceExample]:
    """A seeded uniform sample of `limit` examples (kept in task order); all if limit is None."""
    if limit is None or limit >= len(examples):
        return list(examples)
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    chosen = sorted(random.Random(seed).sample(range(len(examples)), limit))
    return [examples[i] for i in chosen]


class CacheScorer:
    """Scores options with `model`, the context held in a cache from `cache_factory()`.

    cache_factory: a callable returning a fresh transformers Cache (e.g. a CompressedCache);
    None uses a DynamicCache (the fp baseline). Tensors follow the model's device.
    """

    def __init__(self, model, tokenizer, cache_factory: Callable[[], object] | None = None):
        from transformers import DynamicCache

        self.model, self.tokenizer = model, tokenizer
        self.cache_factory = cache_factory or DynamicCache

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @torch.no_grad()
    def __call__(self, context: str, continuations: Sequence[str]) -> ScoredOptions:
        context_ids = self._encode(context)
        option_ids = [self._encode(c) for c in continuations]
        if not context_ids:
            raise ValueError("the context encodes to no tokens")
        if any(not ids for ids in option_ids):
            raise ValueError("an option encodes to no tokens")
        device = next(self.model.parameters()).device
        batch, longest = len(option_ids), max(len(ids) for ids in option_ids)
        cache = self.cache_factory()
        prefix = context_ids[:-1]
        if prefix:
            # One prefill, then one copy of the cached context per option (codes are copied as
            # codes: every option reads back exactly the same compressed context).
            self.model(input_ids=torch.tensor([prefix], device=device), **cache_kwarg(self.model, cache), use_cache=True)
            cache.batch_repeat_interleave(batch)
        compressed = compressed_token_count(cache)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        inputs = torch.tensor([[context_ids[-1]] + ids[:-1] + [pad] * (longest - len(ids)) for ids in option_ids],
                              device=device)
        logits = self.model(input_ids=inputs, **cache_kwarg(self.model, cache), use_cache=True).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        logliks = []
        for row, ids in enumerate(option_ids):
            targets = torch.tensor(ids, device=device)
            logliks.append(float(log_probs[row, : len(ids)].gather(-1, targets[:, None]).sum()))
        return ScoredOptions(tuple(logliks), len(context_ids), compressed)


def compressed_token_count(cache) -> int:
    """Tokens per sequence held only as codes (0 for caches without codes, e.g. DynamicCache)."""
    layers = getattr(cache, "layers", None) or []
    return int(getattr(layers[0], "num_coded", 0)) if layers else 0


@dataclass
class MultipleChoiceResult:
    """Accuracies of one cache configuration over the same examples."""

    name: str
    n: int
    correct: int
    correct_norm: int
    predictions: list[int] = field(default_factory=list)
    predictions_norm: list[int] = field(default_factory=list)
    context_tokens: int = 0
    context_tokens_compressed: int = 0
    by_subtask: dict[str, list[int]] = field(default_factory=dict)  # subtask -> [n, correct, correct_norm]

    @property
    def acc(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.n if self.n else float("nan")

    @staticmethod
    def stderr(p: float, n: int) -> float:
        return math.sqrt(p * (1 - p) / n) if n else float("nan")

    def agreement(self, other: "MultipleChoiceResult", normalised: bool = False) -> float:
        """Fraction of examples where both configurations pick the same option (acc, or acc_norm
        ranking when `normalised`)."""
        mine, theirs = ((self.predictions_norm, other.predictions_norm) if normalised
                        else (self.predictions, other.predictions))
        if len(mine) != len(theirs):
            raise ValueError("results cover different numbers of examples")
        same = sum(a == b for a, b in zip(mine, theirs))
        return same / len(mine) if mine else float("nan")

    def to_dict(self) -> dict:
        return {
            "name": self.name, "n": self.n, "acc": self.acc, "acc_stderr": self.stderr(self.acc, self.n),
            "acc_norm": self.acc_norm, "acc_norm_stderr": self.stderr(self.acc_norm, self.n),
            "context_tokens": self.context_tokens, "context_tokens_compressed": self.context_tokens_compressed,
            "compressed_fraction": (self.context_tokens_compressed / self.context_tokens
                                    if self.context_tokens else 0.0),
            "by_subtask": {k: {"n": v[0], "acc": v[1] / v[0], "acc_norm": v[2] / v[0]}
                           for k, v in sorted(self.by_subtask.items())},
        }


def evaluate_multiple_choice(examples: Sequence[MultipleChoiceExample], scorer: OptionScorer,
                             name: str = "fp", progress: bool = True) -> MultipleChoiceResult:
    """acc and acc_norm of `scorer` over `examples` (a tqdm bar when progress is True)."""
    from tqdm.auto import tqdm

    if not examples:
        raise ValueError("no examples to evaluate")
    result = MultipleChoiceResult(name=name, n=0, correct=0, correct_norm=0)
    for example in tqdm(examples, desc=f"multiple choice [{name}]", disable=not progress, unit="q"):
        context, continuations = split_context(example)
        scored = scorer(context, continuations)
        pred, pred_norm = predictions(scored.logliks, example.options)
        hit, hit_norm = int(pred == example.correct_index), int(pred_norm == example.correct_index)
        result.n += 1
        result.correct += hit
        result.correct_norm += hit_norm
        result.predictions.append(pred)
        result.predictions_norm.append(pred_norm)
        result.context_tokens += scored.context_tokens
        result.context_tokens_compressed += scored.context_tokens_compressed
        tally = result.by_subtask.setdefault(example.subtask, [0, 0, 0])
        tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + hit, tally[2] + hit_norm
    return result


# --------------------------------------------------------------------------- the experiment

@dataclass(frozen=True)
class CacheSetting:
    """One cache configuration: `method` is a spec of `fibquant.codecs.registry` ("fp",
    "fibquant:b=2", "turboquant:b=2", "int:b=4", ...), used for keys and values alike, with an
    exact window of `sink_tokens` + `recent_tokens` (ignored for the uncompressed reference, fp)."""

    method: str = "fp"
    sink_tokens: int = 4
    recent_tokens: int = 32

    def __post_init__(self) -> None:
        parsed = self.parsed  # raises ValueError on a bad spec
        if parsed.calibrated:
            raise ValueError(f"{self.method}: calibrated methods need fitting data and are not supported here")
        for label, value in (("sink_tokens", self.sink_tokens), ("recent_tokens", self.recent_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{label} must be a non-negative integer, got {value!r}")

    @property
    def parsed(self):
        from fibquant.codecs.registry import parse_codec_spec

        if not isinstance(self.method, str):
            raise ValueError(f"method must be a spec string such as 'fibquant:b=2', got {self.method!r}")
        return parse_codec_spec(self.method)

    @property
    def is_fp(self) -> bool:
        """True for the uncompressed reference (scored without a cache)."""
        return self.parsed.reference

    def name(self, head_dim: int = 64) -> str:
        if self.is_fp:
            return self.parsed.spec
        return f"{self.parsed.label(head_dim)} (sink {self.sink_tokens}, recent {self.recent_tokens})"

    def build_codec(self, head_dim: int):
        """The codec for keys and values (for fp the fp16 identity codec: it gives the bytes)."""
        return self.parsed.build(head_dim)

    def cache_factory(self, head_dim: int, codec=None) -> Callable[[], object] | None:
        """None for fp (no cache); else a factory of CompressedCache sharing one codec (built once
        here unless given)."""
        if self.is_fp:
            return None
        from fibquant.kv.cache import CompressedCache

        codec = codec if codec is not None else self.build_codec(head_dim)
        # encode_batch=1: every context token outside the window is compressed, however short the context.
        return lambda: CompressedCache(codec, codec, sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens,
                                       encode_batch=1)


def default_settings(bits: Sequence[float] = (4, 2), sink_tokens: int = 4, recent_tokens: int = 32,
                     small_window: tuple[int, int] | None = (0, 0),
                     caches: Sequence[str] = ()) -> list[CacheSetting]:
    """fp, then FibQuant at each rate in `bits` plus the extra `caches` (baseline specs such as
    "turboquant:b=2"), with the standard window and again with the small window.

    BIG-bench questions are short (~30 tokens), so the standard 4 + 32 window keeps almost all
    of them exact; `small_window` = (sink, recent) makes compression actually matter.
    """
    specs = [f"fibquant:b={b:g}" for b in bits] + list(caches)
    settings = [CacheSetting("fp")] + [CacheSetting(spec, sink_tokens, recent_tokens) for spec in specs]
    if small_window is not None and tuple(small_window) != (sink_tokens, recent_tokens):
        settings += [CacheSetting(spec, *small_window) for spec in specs]
    return settings


def run_multiple_choice(model, tokenizer, task: str = "goal_step_wikihow", limit: int | None = 200,
                        settings: Sequence[CacheSetting] | None = None, seed: int = 0,
                        progress: bool = True, examples: Sequence[MultipleChoiceExample] | None = None) -> dict:
    """Evaluate every setting on the same seeded sample of `task`; returns the JSON payload.

    Each row: the cache (`cache`: its spec; `label`: its name with the window), acc, acc_norm
    (with binomial standard errors), their ratios to fp, the fraction of examples where the
    setting picks the same option as fp, and how many context tokens were read back from codes. `examples` overrides loading the task (tests).
    """
    from fibquant.data.bigbench import load_bigbench_task
    from fibquant.kv.model import check_model_supported, describe_model

    with attention_on_codes(model):
        settings = list(settings) if settings is not None else default_settings()
        if not settings or not settings[0].is_fp:  # fp first: every ratio and agreement refers to it
            settings = [CacheSetting("fp")] + [s for s in settings if not s.is_fp]
        pool = list(examples) if examples is not None else load_bigbench_task(task)
        chosen = select_examples(pool, limit, seed)
        head_dim = check_model_supported(model)["head_dim"]
        results, code_bytes = [], {}
        for setting in settings:
            codec = setting.build_codec(head_dim)
            code_bytes[setting] = codec.code_size
            scorer = CacheScorer(model, tokenizer, setting.cache_factory(head_dim, codec))
            results.append((setting, evaluate_multiple_choice(chosen, scorer, setting.name(head_dim), progress)))
        baseline = results[0][1]
        rows = []
        for setting, result in results:
            # the cache's spec and label lead, as in every experiment comparing caches
            row = {"cache": setting.parsed.spec, "label": result.name}
            row.update({key: value for key, value in result.to_dict().items() if key != "name"})
            row.update(code_bytes=code_bytes[setting],
                       ratio_vs_fp16=2 * head_dim / code_bytes[setting],
                       sink_tokens=setting.sink_tokens, recent_tokens=setting.recent_tokens,
                       acc_ratio=result.acc / baseline.acc if baseline.acc else float("nan"),
                       acc_norm_ratio=result.acc_norm / baseline.acc_norm if baseline.acc_norm else float("nan"),
                       agreement_with_fp=result.agreement(baseline),
                       agreement_norm_with_fp=result.agreement(baseline, normalised=True),
                       mean_context_tokens=result.context_tokens / result.n,
                       mean_compressed_tokens=result.context_tokens_compressed / result.n)
            rows.append(row)
        chance = sum(1 / len(e.options) for e in chosen) / len(chosen)
        return {"experiment": "multiple_choice", "task": task, "bigbench_version": "1.0.0",
                "model": describe_model(model), "n_examples": len(chosen), "pool_size": len(pool), "seed": seed,
                "chance_accuracy": chance, "protocol": __doc__.split("Protocol with a cache")[1].strip(),
                "rows": rows}


MC_COLUMNS = [("label", "cache", ""), ("code_bytes", "B/vec", "d"), ("ratio_vs_fp16", "x fp16", ".2f"),
              ("acc", "acc", ".3f"), ("acc_stderr", "±", ".3f"), ("acc_norm", "acc_norm", ".3f"),
              ("acc_norm_stderr", "±", ".3f"), ("acc_ratio", "acc/fp", ".3f"), ("acc_norm_ratio", "norm/fp", ".3f"),
              ("agreement_with_fp", "same as fp", ".3f"), ("agreement_norm_with_fp", "same (norm)", ".3f"),
              ("mean_context_tokens", "ctx tok", ".1f"), ("mean_compressed_tokens", "coded tok", ".1f")]


def plot_multiple_choice(payload: dict, path) -> None:
    """Left: acc and acc_norm per setting (standard-error bars, chance level). Right: fraction of
    questions where each setting picks the same option as fp (more sensitive than accuracy)."""
    rows = payload["rows"]
    x = list(range(len(rows)))
    labels = [r["label"].replace(" (", "\n(") for r in rows]
    width = 0.38
    with figure(path, ncols=2, figsize=(max(10, 2.6 * len(rows)), 4.8)) as (fig, (left, right)):
        for ax, keys, title in ((left, ("acc", "acc_norm"), "accuracy"),
                                (right, ("agreement_with_fp", "agreement_norm_with_fp"), "same choice as fp")):
            for shift, key in zip((-width / 2, width / 2), keys):
                errors = [r[f"{key}_stderr"] for r in rows] if f"{key}_stderr" in rows[0] else None
                ax.bar([i + shift for i in x], [r[key] for r in rows], width, yerr=errors, capsize=3,
                       label=key.replace("agreement_with_fp", "acc ranking").replace("agreement_norm_with_fp",
                                                                                     "acc_norm ranking"))
            ax.set_xticks(x, labels, fontsize=6)
            ax.set_ylabel(title)
            ax.legend(fontsize=7, loc="lower left")
        left.axhline(payload["chance_accuracy"], color="grey", linestyle="--", label="chance")
        left.legend(fontsize=7, loc="lower left")
        right.set_ylim(0, 1.05)
        fig.suptitle(f"BIG-bench {payload['task']} (n={payload['n_examples']}), {payload['model']}", fontsize=8)


@dataclass(frozen=True)
class MultipleChoiceConfig:
    """A seeded sample of `limit` examples of `task` (None: all; see `select_examples`), scored with
    fp and the `default_settings(bits, sink_tokens, recent_tokens, small_window, caches)`."""

    task: str = "goal_step_wikihow"
    limit: int | None = 200
    bits: tuple[float, ...] = (4, 2)
    caches: tuple[str, ...] = ()
    sink_tokens: int = 4
    recent_tokens: int = 32
    small_window: tuple[int, int] | None = (0, 0)
    seed: int = 0


def run(config: MultipleChoiceConfig = MultipleChoiceConfig(), model_and_tokenizer=None, progress: bool = True,
        examples: Sequence[MultipleChoiceExample] | None = None) -> dict:
    """`run_multiple_choice` with `config`'s settings on `model_and_tokenizer` (default: the default model)."""
    from fibquant.kv.model import load_model

    model, tokenizer = model_and_tokenizer or load_model()
    settings = default_settings(config.bits, config.sink_tokens, config.recent_tokens, config.small_window,
                                config.caches)
    return run_multiple_choice(model, tokenizer, config.task, config.limit, settings, config.seed, progress, examples)


def mc_header(payload: dict) -> str:
    return (f"Multiple choice: BIG-bench {payload['task']} (HellaSwag substitute), {payload['n_examples']} of "
            f"{payload['pool_size']} examples (seed {payload['seed']}), {payload['model']}; "
            f"chance {payload['chance_accuracy']:.3f}")


def mc_table(payload: dict) -> str:
    return (format_table(payload["rows"], MC_COLUMNS) + "\nB/vec: stored bytes per key (or value) vector outside "
            "the window, x fp16: compression of those vectors against fp16; same as fp: fraction of questions "
            "answered like fp; ctx tok: mean context tokens per question; coded tok: mean context tokens the "
            "scoring pass read back from codes")


EXPERIMENT = Experiment(name="multiple-choice", stem="multiple_choice", config=MultipleChoiceConfig, run=run, table=mc_table,
                        plot=plot_multiple_choice, header=mc_header)


def save_multiple_choice(payload: dict, out_dir) -> dict[str, str]:
    """Write multiple_choice.json and multiple_choice.png under out_dir; return their paths."""
    return EXPERIMENT.report(payload, out_dir, echo=False)
