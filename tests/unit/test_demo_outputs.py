"""The demo's outputs say what they show: the per-rank plot puts every policy on one y scale with
whole-request ticks (matplotlib's own figure, read back), the table names its throughput as
simulated and says how to get the wall-clock one, and a router process that logged nothing
leaves no empty log file (a real subprocess)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fastroute.sim.balance import RouterProcess
from fastroute.sim.report import markdown_table, outstanding_figure

matplotlib = pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
matplotlib.use("Agg")


def _row(label: str, peak: int) -> dict:
    # (t, step_ms, running, outstanding per rank, kv): a calm policy and a bursty one.
    samples = [(float(i), 10.0, [0, 0], [peak if i % 3 == 0 else 1, 2], [0, 0]) for i in range(20)]
    return {"label": label, "concurrency": 8, "samples": samples, "t0": 0.0, "balance": {"outstanding_cv": 0.1}}


def test_every_panel_shares_one_y_scale_with_integer_ticks() -> None:
    fig = outstanding_figure([_row("demand", 3), _row("round_robin", 41)], 8)
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == 2
    assert axes[0].get_ylim() == axes[1].get_ylim()  # the calm panel is drawn on the bursty one's scale
    assert axes[0].get_ylim()[1] >= 41
    for ax in axes:
        ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_table_says_its_throughput_is_simulated() -> None:
    load = dict.fromkeys(
        ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "interactivity_p50", "interactivity_p90"), 1.0
    )
    load.update(output_tok_s=400.0, completed=3, errors=0)
    md = markdown_table([{"label": "rr", "concurrency": 8, "load": load, "balance": {}}], 0.25)
    assert "out tok/s (simulated)" in md
    assert "divided by the time scale (0.25)" in md and "wall-clock" in md


def test_a_router_process_that_said_nothing_leaves_no_log(tmp_path) -> None:
    quiet, loud = tmp_path / "quiet.log", tmp_path / "loud.log"

    async def go() -> None:
        for path, code in (
            (quiet, "import time; time.sleep(30)"),
            (loud, "print('hello', flush=True); import time; time.sleep(30)"),
        ):
            rp = RouterProcess([sys.executable, "-c", code], 1, str(path))
            with pytest.raises(RuntimeError):
                await rp.start(timeout=1.0)  # never ready (nothing listens): start stops it
            await rp.stop()

    asyncio.run(go())
    assert not quiet.exists()
    assert loud.read_text() == "hello\n"
