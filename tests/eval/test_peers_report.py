"""`fibquant eval peers`: config, targets, CLI, and the quick path on the real model (tables, JSON, plots agree)."""
from __future__ import annotations

import json

import pytest
from _kv_helpers import real_model

from fibquant.cli import build_parser, main
from fibquant.kv.specs import parse_cache_spec
from fibquant.peers import unavailable_reason
from fibquant.eval.peers import (EXPERIMENT, PeersConfig, budget_check, metric_columns, metric_table,
                                        peers_checks, run, spec_row)
from fibquant.eval.report import get_experiment


def test_registered_and_config_checks():
    assert get_experiment("peers") is EXPERIMENT
    quick = PeersConfig.quick()
    assert quick.fidelity_tokens < PeersConfig().fidelity_tokens and quick.lengths == (256,)
    assert PeersConfig.quick(keys_per_cell=3).keys_per_cell == 3
    assert quick.needle_config().lengths == (256,) and quick.perplexity_config().windows == 1
    for kwargs, match in (({"metrics": ("bleu",)}, "metrics"), ({"metrics": ()}, "metrics"),
                          ({"lengths": (64,)}, "lengths"), ({"context": 16}, "exact window"),
                          ({"fidelity_tokens": 30}, "exact window")):
        with pytest.raises(ValueError, match=match):
            PeersConfig(**kwargs)
    PeersConfig(metrics=("fidelity",), lengths=(64,))  # only the metrics run are checked


def _row(spec: str, **metrics) -> dict:
    return spec_row(parse_cache_spec(spec), 64) | metrics


def test_budget_check_counts_fibquant_at_no_more_bytes():
    rows = [_row("fp", cosine=1.0), _row("fibquant:b=2", cosine=0.97), _row("fibquant:b=2/fibquant:b=1", cosine=0.95),
            _row("turboquant:b=2", cosine=0.99), _row("int:b=4", cosine=0.999)]
    rows.append(_row("quanto-rt:b=2", cosine=0.96) | {"kind": "peer"})    # 20 B: FibQuant b=2 (18 B) 0.97 beats it
    rows.append(_row("hqq-rt:b=4", cosine=0.998) | {"kind": "peer"})      # 36 B: FibQuant's best at <= 36 B is 0.97
    rows.append(_row("kakeya-d4:q=1", cosine=0.5) | {"kind": "peer"})  # 16 B: only K2/V1 (14 B, 0.95) counts
    check = budget_check(rows, "fidelity")
    assert check["peers"] == 3 and check["matched"] == 2
    assert len(check["misses"]) == 1 and check["misses"][0].startswith("HQQ INT4")
    assert budget_check(rows, "fidelity", lo=7.0, hi=7.2)["peers"] == 0  # no peer between 7.0 and 7.2x
    # FibQuant's residual code counts as FibQuant (it beats HQQ INT4 here); TurboQuant above never did
    check = budget_check(rows + [_row("fibrvq:b=4,nc=1", cosine=0.999)], "fidelity")
    assert check["matched"] == 3 and not check["misses"]
    assert budget_check(rows + [_row("fibrvq:b=2/turboquant:b=4", cosine=0.999)], "fidelity")["matched"] == 2
    # perplexity: lower is better
    ppl = [_row("fibquant:b=2", perplexity=33.0), _row("nexus:b=2", perplexity=34.0) | {"kind": "peer"},
           _row("kakeya-e8:q=2", perplexity=32.0) | {"kind": "peer"}]
    check = budget_check(ppl, "perplexity")
    assert check["matched"] == 1 and "KakeyaLattice E8 Q=2" in check["misses"][0]
    checks = peers_checks({"rows": ppl, "parts": {"perplexity": {"checks": []}}})
    assert len(checks) == 1 and checks[0]["met"] is False


def test_cli_arguments(capsys):
    from fibquant.cli.peers import config_from_args

    args = build_parser().parse_args(["eval", "peers", "--quick", "--keys", "2", "--depths", "0.1,0.9",
                                      "--metrics", "needle", "perplexity"])
    config = config_from_args(args)
    assert config == PeersConfig.quick(keys_per_cell=2, depths=(0.1, 0.9), metrics=("needle", "perplexity"))
    assert config_from_args(build_parser().parse_args(["eval", "peers"])) == PeersConfig()
    assert main(["eval", "peers", "--metrics", "bleu", "--threads", "1"]) == 2
    assert "metrics" in capsys.readouterr().err


@pytest.mark.model
def test_quick_run_tables_json_plots_agree(request, tmp_path, monkeypatch):
    """The quick path on the real model: every row's bytes are its cache spec's, fp is the reference of
    every metric, and the JSON, the tables and the plots hold the same rows; a peer whose package is
    missing is a row with its reason and no figures."""
    model, tokenizer = real_model(request)
    peer = "kakeya-e8:q=2"
    specs = ["fp", "fibquant:b=2", "fibquant:b=2/fibquant:b=1", "int:b=4", peer, "hqq-rt:b=2"]
    import fibquant.kv.specs as cache_specs

    real_reason = cache_specs.unavailable_reason
    monkeypatch.setattr(cache_specs, "unavailable_reason",  # hqq stands for an absent package
                        lambda s: "hqq is not importable (test)" if s.family == "hqq-rt" else real_reason(s))
    payload = run(PeersConfig.quick(), caches=specs, model_and_tokenizer=(model, tokenizer), progress=False)
    paths = EXPERIMENT.report(payload, tmp_path, echo=False)

    rows = {r["cache"]: r for r in payload["rows"]}
    assert list(rows) == specs
    for spec, row in rows.items():
        cache = parse_cache_spec(spec)
        assert (row["key_bytes"], row["value_bytes"]) == (cache.key_bytes(64), cache.value_bytes(64))
        assert row["codes_ratio"] == pytest.approx(256 / (row["key_bytes"] + row["value_bytes"]))
    kv = rows["fibquant:b=2/fibquant:b=1"]
    assert kv["key_bytes"] == 18 and kv["value_bytes"] == 10
    skipped = rows["hqq-rt:b=2"]
    assert not skipped["available"] and "not importable (test)" in skipped["note"]
    assert all(skipped.get(k) is None for k in ("cosine", "perplexity", "needle_accuracy"))
    ran = [r for r in rows.values() if r["available"]]
    if unavailable_reason(peer) is not None:
        assert not rows[peer]["available"] and "fibquant[peers]" in rows[peer]["note"]
    else:
        assert rows[peer]["kind"] == "peer" and rows[peer]["key_bytes"] == 23

    fp = rows["fp"]
    assert fp["cosine"] == pytest.approx(1.0, abs=1e-5) and fp["cosine_worst_layer"] == pytest.approx(1.0, abs=1e-5)
    assert fp["perplexity_change_pct"] == 0.0 and fp["needle_accuracy"] == 1.0 and fp["needle_misses_vs_fp"] == 0
    for row in ran:
        assert 0.0 < row["cosine"] <= 1.0 + 1e-6 and row["perplexity"] > 1.0
        assert row["perplexity"] / fp["perplexity"] == pytest.approx(1 + row["perplexity_change_pct"] / 100)
        assert row["needle_trials"] == 1 and row["needle_accuracy"] in (0.0, 1.0)
    # the merged rows are the experiments' own rows
    parts = payload["parts"]
    assert [r["cache"] for r in parts["perplexity"]["rows"]] == [r["cache"] for r in ran]
    assert [r["cache"] for r in parts["fidelity"]["rows"]] == [r["cache"] for r in ran]
    for part in parts.values():  # every row names its cache as the speed rows do: cache (spec) + label
        assert all(set(r) >= {"cache", "label"} and not set(r) & {"method", "spec"} for r in part["rows"])
        assert [r["label"] for r in part["rows"]] == [r["label"] for r in ran]
    for part_row in parts["perplexity"]["rows"]:
        assert rows[part_row["cache"]]["perplexity"] == part_row["perplexity"]
        assert part_row["key_bytes_per_vector"] == rows[part_row["cache"]]["key_bytes"]
    for part_row in parts["needle"]["rows"]:
        assert rows[part_row["cache"]]["needle_accuracy"] == part_row["accuracy"]

    # JSON on disk == payload; tables list every spec with its figures; plots written
    on_disk = json.loads((tmp_path / "peers.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(payload["rows"]))
    assert on_disk["model"].startswith("SmolLM2-135M-Instruct") and on_disk["text"] == "emma"
    for metric, key, spec in (("fidelity", "cosine", ".4f"), ("perplexity", "perplexity", ".3f"),
                              ("needle", "needle_accuracy", ".3f")):
        table = (tmp_path / f"peers_{metric}.md").read_text()
        assert "SmolLM2-135M-Instruct" in table and "emma" in table
        assert table.strip().endswith(metric_table(payload, metric).strip())
        header_cells = [title for _, title, _ in metric_columns(payload, metric)]
        lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert len(lines) == len(specs)
        index = header_cells.index(next(t for k, t, _ in metric_columns(payload, metric) if k == key))
        for line in lines:
            cells = [c.strip() for c in line.strip("|").split("|")]
            row = next(r for r in rows.values() if r["label"] == cells[0])
            assert cells[index] == ("-" if row.get(key) is None else format(row[key], spec))
            assert cells[header_cells.index("K B/vec")] == format(row["key_bytes"], ".4g")
            assert ("not importable" in cells[-1]) == (not row["available"])
        assert f"### {metric}" in (tmp_path / "peers.md").read_text()
        png = tmp_path / f"peers_{metric}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert paths[f"{metric}_png"] == str(png)
    assert (tmp_path / "peers.png").stat().st_size > 10_000
