"""One shape for every experiment, and one way to report it: JSON, a text table and a PNG.

An experiment is one module under `fibquant.eval` that defines a frozen config dataclass, a
`run(config, **resources) -> payload` function (the payload is a JSON-able dict) and

    EXPERIMENT = Experiment(name="passkey", stem="passkey", config=PasskeyConfig, run=run,
                            columns=PASSKEY_COLUMNS, plot=plot_passkey, targets=passkey_targets)

`EXPERIMENTS` below maps each name to its module (imported on first use, so listing the
experiments does not import torch). `Experiment.report(payload, out_dir)` prints the header,
the table and the targets, writes `<stem>.json` and `<stem>.png` under the results directory
(`fibquant.paths.results_dir`: `--out`, else `$FIBQUANT_RESULTS_DIR`, else `./results`) and
returns their paths; `Experiment.main(config, out_dir, **resources)` is run + report.

To add an experiment:

1. write `fibquant/eval/<module>.py` with the config, `run`, its columns (a list of
   `(row key, header, format spec)` over `payload[rows_key]`, or a function of the payload),
   its targets (payload -> list of `target(...)` dicts; keep the thresholds as constants in
   that module) and its plot (`plot(payload, path)`, drawn inside
   `with figure(path, figsize=...) as (fig, ax):`), then `EXPERIMENT = Experiment(...)`;
2. add one line `"<name>": "fibquant.eval.<module>"` to `EXPERIMENTS`;
3. for a command, add `register_eval(eval_subparsers)` to a module of `fibquant.cli` (a new
   module also gets one line in `fibquant.cli._COMMAND_MODULES`): build the config from the
   arguments (shared flags in `fibquant.cli._common`) and call
   `run_experiment("<name>", config, args.out, **resources)`.

Adopting it in an existing experiment: the table goes through `format_table` (Markdown with
`markdown=True`), the matplotlib preamble (`matplotlib.use("Agg")`, `subplots`,
`tight_layout`, `savefig`, `close`) becomes `with figure(path, ...)`, the JSON/PNG writing
becomes `Experiment.report(payload, out_dir)` (`echo=False` to only write), targets become
`target(...)` dicts, and `time.perf_counter` bookkeeping uses `fibquant.eval.timing`. A stem
that depends on the run (e.g. a suffix) is a function of the payload (`stem=lambda payload:
...`) or `dataclasses.replace(EXPERIMENT, stem=...)`; a table also kept as a file is
`table_suffix=".md"`; a PNG named other than `<stem>.png` is `plot_suffix="_frontier.png"`.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from fibquant import _json as strict_json
from fibquant.paths import results_dir

Column = tuple[str, str, str]   # (row key, header, format spec such as ".3f"; "" prints str(value))
Columns = Union[Sequence[Column], Callable[[dict], Sequence[Column]]]

# name -> module defining EXPERIMENT; one line per experiment.
EXPERIMENTS: dict[str, str] = {
    "rate-distortion": "fibquant.eval.rate_distortion",
    "canonical-source": "fibquant.eval.canonical_source",
    "needle": "fibquant.eval.needle",
    "archive-kv": "fibquant.eval.archive.kv",
    "demo": "fibquant.eval.demo",
    "fidelity": "fibquant.eval.fidelity",
    "perplexity": "fibquant.eval.perplexity",
    "multiple-choice": "fibquant.eval.multiple_choice",
    "decode-speed": "fibquant.eval.decode_speed",
    "archive-bench": "fibquant.eval.archive.bench",
    "peers": "fibquant.eval.peers",
}


# --------------------------------------------------------------------------- tables

def format_table(rows: Sequence[dict], columns: Sequence[Column], markdown: bool = False) -> str:
    """A plain-text table (first column left-aligned, the others right-aligned), or a Markdown one.

    A missing or None value prints as "-".
    """
    def cell(row: dict, key: str, spec: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, spec) if spec else str(value)

    header = [title for _, title, _ in columns]
    body = [[cell(row, key, spec) for key, _, spec in columns] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(line) + " |" for line in body])
    cells = [header, *body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    rendered = [" | ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
                for r in cells]
    rendered.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(rendered)


def target(name: str, measured: Any, met: Optional[bool], detail: str = "") -> dict:
    """One checked target: its statement, the measured figure, met (None: could not be judged)."""
    return {"target": name, "measured": measured, "detail": detail, "met": met}


def format_targets(targets: Sequence[dict]) -> str:
    """`[met] name: measured X (detail)` per target; `[n/a]` when it could not be judged."""
    lines = []
    for t in targets:
        status = "n/a" if t["met"] is None else "met" if t["met"] else "MISSED"
        measured = t["measured"]
        shown = f"{measured:.4g}" if isinstance(measured, float) else str(measured)
        detail = f" ({t['detail']})" if t.get("detail") else ""
        lines.append(f"  [{status}] {t['target']}: measured {shown}{detail}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- figures and files

def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    from fibquant._extras import require

    require("matplotlib", "plotting a report").use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path, *, dpi: int = 120, tight: bool = True, **subplots) -> Iterator[tuple]:
    """`with figure(path, figsize=(8, 5)) as (fig, ax):` draw; on exit tight-layout, save, close.

    Keyword arguments other than dpi/tight go to `plt.subplots`. Nothing is saved if drawing raises.
    """
    plt = pyplot()
    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        if tight:
            fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def write_json(path, payload: dict) -> Path:
    """Write `payload` as indented JSON (numpy / torch scalars through float; NaN / Inf as null); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json.dumps(payload, indent=2, default=float))
    return path


def save_report(payload: dict, out_dir, stem: str, plot: Optional[Callable] = None,
                table: Optional[str] = None, table_suffix: Optional[str] = None,
                plot_suffix: str = ".png") -> dict[str, str]:
    """Write `<stem>.json`, `<stem><plot_suffix>` (drawn by `plot(payload, path)`) and, when
    `table_suffix` is given, `<stem><table_suffix>` holding `table`, under `results_dir(out_dir)`.

    Returns {"json": path, "png": path[, "table": path]} as strings.
    """
    folder = results_dir(out_dir)
    paths = {"json": str(write_json(folder / f"{stem}.json", payload))}
    if plot is not None:
        png = folder / f"{stem}{plot_suffix}"
        plot(payload, png)
        paths["png"] = str(png)
    if table_suffix is not None and table is not None:
        table_path = folder / f"{stem}{table_suffix}"
        table_path.write_text(table + "\n")
        paths["table"] = str(table_path)
    return paths


# --------------------------------------------------------------------------- experiments

@dataclass(frozen=True)
class Experiment:
    """What the report module needs to know about one experiment.

    name: registry / command name; stem: output file stem (or payload -> stem); config: its
    frozen config class; run: `run(config, **resources) -> payload`; columns: table columns (or
    payload -> columns) over `payload[rows_key]`; plot: `plot(payload, path)`; targets: payload
    -> `target` dicts; header: payload -> lines printed above the table; table: payload -> the
    whole table text (for experiments whose table is not one row list); markdown: Markdown
    table; table_suffix: also write the table to `<stem><table_suffix>`.
    """

    name: str
    stem: Union[str, Callable[[dict], str]]
    config: type
    run: Callable[..., dict]
    columns: Columns = ()
    plot: Optional[Callable[[dict, Path], None]] = None
    targets: Optional[Callable[[dict], list]] = None
    header: Optional[Callable[[dict], str]] = None
    table: Optional[Callable[[dict], str]] = None
    rows_key: str = "rows"
    markdown: bool = False
    table_suffix: Optional[str] = None
    plot_suffix: str = ".png"

    def table_text(self, payload: dict) -> str:
        """The experiment's table for `payload`."""
        if self.table is not None:
            return self.table(payload)
        columns = self.columns(payload) if callable(self.columns) else self.columns
        return format_table(payload[self.rows_key], columns, markdown=self.markdown)

    def stem_of(self, payload: dict) -> str:
        """The output file stem for `payload`."""
        return self.stem(payload) if callable(self.stem) else self.stem

    def target_list(self, payload: dict) -> list:
        return [] if self.targets is None else list(self.targets(payload))

    def report(self, payload: dict, out_dir=None, echo: bool = True) -> dict[str, str]:
        """Print header, table and targets (unless `echo` is False); write JSON and PNG; their paths."""
        table = self.table_text(payload)
        if echo:
            if self.header is not None:
                print(self.header(payload))
            print(table)
            targets = self.target_list(payload)
            if targets:
                print("Targets\n" + format_targets(targets))
        paths = save_report(payload, out_dir, self.stem_of(payload), self.plot, table, self.table_suffix,
                            self.plot_suffix)
        if echo:
            print("wrote " + " and ".join(paths.values()))
        return paths

    def main(self, config=None, out_dir=None, **resources) -> dict:
        """Run with `config` (default: the config class's defaults), report, return the payload."""
        payload = self.run(self.config() if config is None else config, **resources)
        self.report(payload, out_dir)
        return payload


def get_experiment(name: str) -> Experiment:
    """The registered experiment `name`; ValueError listing the names otherwise."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; registered: {', '.join(sorted(EXPERIMENTS))}")
    module = importlib.import_module(EXPERIMENTS[name])
    experiment = getattr(module, "EXPERIMENT", None)
    if not isinstance(experiment, Experiment) or experiment.name != name:
        raise TypeError(f"{EXPERIMENTS[name]} must define EXPERIMENT = Experiment(name={name!r}, ...)")
    return experiment
