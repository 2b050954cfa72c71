"""Arguments shared by several commands, defined once so they read and behave alike everywhere.

- `--caches`: cache specs (`fibquant.kv.specs`), separated by spaces or ';' (both accepted:
  `--caches fp int:b=4` and `--caches 'fp;int:b=4'`; specs themselves may contain ','); every
  command spells it so;
- lists of numbers or names (`--layers`, `--lengths`, `--parts`, ...): separated by spaces,
  ',' or ';' (`--layers 0 7 15` and `--layers 0,7,15` alike);
- `--out`: the results folder (default `$FIBQUANT_RESULTS_DIR`, else ./results; fibquant.paths);
- `--text`, `--model`, `--threads` (the last from `_threads`).

`run_experiment` runs a registered experiment (fibquant.eval.report) and reports it.
"""
from __future__ import annotations

import argparse
import re

from ._threads import add_threads_argument, apply_threads  # noqa: F401 - re-exported

OUT_HELP = "results folder (default $FIBQUANT_RESULTS_DIR or ./results)"


def split_specs(text: str) -> list[str]:
    """'fp;int:b=4 turboquant:b=2' -> ['fp', 'int:b=4', 'turboquant:b=2'] (';' or whitespace)."""
    return [part for part in re.split(r"[;\s]+", text) if part]


def split_items(text: str) -> list[str]:
    """'0,7 15;29' -> ['0', '7', '15', '29'] (',', ';' or whitespace)."""
    return [part for part in re.split(r"[,;\s]+", text) if part]


class _ListAction(argparse.Action):
    """nargs='+' values, each split (by `split`) and converted (by `convert`), flattened into one list."""

    def __init__(self, *args, split=split_specs, convert=str, **kwargs):
        self.split, self.convert = split, convert
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        items = [item for value in values for item in self.split(value)]
        if not items:
            parser.error(f"{option_string} needs at least one value")
        try:
            converted = [self.convert(item) for item in items]
        except ValueError:
            parser.error(f"{option_string}: expected {self.convert.__name__} values, got {' '.join(values)!r}")
        setattr(namespace, self.dest, converted)


def add_specs_argument(parser: argparse.ArgumentParser, default=None, help: str = "cache specs") -> None:
    """`--caches SPEC [SPEC ...]`, specs separated by spaces or ';';
    parsed into a list of strings at `args.caches`."""
    parser.add_argument("--caches", dest="caches", nargs="+", action=_ListAction,
                        default=default, metavar="SPEC", help=f"{help} (separated by spaces or ';')")


def add_list_argument(parser: argparse.ArgumentParser, flag: str, type=int, default=None, help: str = "",
                      metavar: str = "N") -> None:
    """`flag V [V ...]`, values separated by spaces, ',' or ';', converted by `type`, as a list."""
    parser.add_argument(flag, nargs="+", action=_ListAction, split=split_items, convert=type, default=default,
                        metavar=metavar, help=f"{help} (separated by spaces or ',')".lstrip())


def add_out_argument(parser: argparse.ArgumentParser, help: str = OUT_HELP) -> None:
    """`--out DIR` (default None: `fibquant.paths.results_dir()` decides)."""
    parser.add_argument("--out", default=None, help=help)


def add_text_argument(parser: argparse.ArgumentParser, default: str = "emma",
                      help: str = "novel to read (fibquant data list)") -> None:
    parser.add_argument("--text", default=default, help=f"{help}; default {default}")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file or local model directory (default: SmolLM2-135M)")


def run_experiment(name: str, config, out_dir=None, **resources) -> dict:
    """Run the registered experiment `name` with `config`, print its report, write its files."""
    from fibquant.eval.report import get_experiment

    return get_experiment(name).main(config, out_dir, **resources)
