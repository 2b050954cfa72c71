"""`fibquant data ...`, `fibquant eval canonical-source|mc`: argument handling and error reporting (offline)."""
from __future__ import annotations

from fibquant.cli import main
from fibquant.data import text as text_module


def test_data_fetch_without_apt_reports_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(text_module.shutil, "which", lambda name: None)
    assert main(["data", "fetch", "--texts"]) == 1
    assert "apt-get update && apt-get download r-cran-janeaustenr" in capsys.readouterr().err


def test_data_list_shows_texts_and_cache_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / f"persuasion.{text_module.CLEANING_VERSION}.txt").write_text("Persuasion\n")
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "pride_and_prejudice" in out and "moby_dick" in out
    assert [line for line in out.splitlines() if "[cached]" in line][0].split()[0] == "persuasion"
    assert "BIG-bench tasks cached" in out and out.rstrip().endswith("none")


def test_eval_mc_rejects_bad_arguments_before_loading_the_model(capsys):
    assert main(["eval", "multiple-choice", "--limit", "-1"]) == 2
    assert "--limit must be >= 0" in capsys.readouterr().err
    assert main(["eval", "multiple-choice", "--threads", "0", "--limit", "5"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main(["eval", "canonical-source", "--tokens", "1"]) == 2
    assert "tokens must be an integer >= 2" in capsys.readouterr().err
