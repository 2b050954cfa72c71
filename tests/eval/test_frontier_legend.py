"""The fidelity plot's legend names dots ("other k, N") only when points off the FibQuant front are drawn."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="plots need the eval extra")


def _plotted(rows, monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    from fibquant.eval.fidelity import plot_frontier

    seen = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (seen.append(fig), real_close(fig)))
    plot_frontier(rows, tmp_path / "f.png", "t")
    ax = seen[0].axes[0]
    return [t.get_text() for t in ax.get_legend().get_texts()], sum(len(c.get_offsets()) for c in ax.collections)


def _row(ratio, cosine):
    return {"family": "fibquant", "compression_ratio": ratio, "cosine": cosine}


def test_no_dots_promised_when_every_point_is_on_the_front(monkeypatch, tmp_path):
    legend, dots = _plotted([_row(4, 0.99), _row(8, 0.95)], monkeypatch, tmp_path)
    assert legend == ["FibQuant"] and dots == 0


def test_dots_drawn_and_named_when_a_point_is_off_the_front(monkeypatch, tmp_path):
    legend, dots = _plotted([_row(4, 0.99), _row(8, 0.95), _row(4, 0.9)], monkeypatch, tmp_path)
    assert legend == ["FibQuant (frontier; dots: other k, N)"] and dots == 1
