"""The Parallel panel: every data-parallel rank's queue, running batch, KV usage and
generation rate side by side with an imbalance verdict, and every pipeline stage's
utilisation and bytes sent per second (with DP x PP, each rank's stages and a verdict per
rank). Shown only when the run has more than one DP rank or PP stage.

The figures come from :mod:`engine.events.folds.parallel_window` (the fold, the window and the
verdict, on the doctor's definitions and bound): kvscope's dashboard hands it the view's fold
of step events (:meth:`ParallelPanel.update_view`), a vLLM replica's screen the
``engine``-labelled series of its scrapes (:meth:`ParallelPanel.update_state`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Group, JustifyMethod
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from engine.events.folds.parallel_window import (
    WINDOW_S,
    RankWindow,
    StageWindow,
    imbalance_verdict,
    stage_verdict,
)
from engine.events.folds.view import EngineView
from monitor.replica import ReplicaState
from monitor.widgets.numbers import number

BAR_CELLS = 10  # a stage's utilisation bar


def rate_text(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{number(round(value, 1))} {unit}"


def bytes_rate(value: float | None) -> str:
    if value is None:
        return "–"
    for size, unit in ((2**30, "GiB/s"), (2**20, "MiB/s"), (2**10, "KiB/s")):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B/s"


def rank_table(ranks: Sequence[RankWindow], window_s: float) -> Table:
    """One row per rank: each figure now and its window mean in brackets."""
    table = Table(box=None, padding=(0, 2), show_edge=False, title_justify="left",
                  title=f"DP ranks (now, mean over the last {window_s:g} s)")
    for column in ("rank", "waiting", "running", "KV %", "gen tok/s"):
        table.add_column(column, justify="right")
    for rank in ranks:
        table.add_row(rank.rank, f"{number(rank.waiting)} ({number(round(rank.mean_waiting, 1))})",
                      f"{number(rank.running)} ({number(round(rank.mean_running, 1))})",
                      f"{rank.kv_pct:.0f} ({rank.mean_kv_pct:.0f})", rate_text(rank.gen_tps, ""))
    return table


def stage_table(rank_stages: Mapping[int, Sequence[StageWindow]], window_s: float) -> Table:
    """One row per stage; with several DP ranks' pipelines, each rank's stages, the rank first."""
    by_rank = len(rank_stages) > 1
    table = Table(box=None, padding=(0, 2), show_edge=False, title_justify="left",
                  title=f"PP stages{' per DP rank' if by_rank else ''} (last {window_s:g} s of steps)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("rank", "right"),) if by_rank else ()
    for column, justify in (*columns, ("stage", "right"), ("busy", "right"), ("", "left"),
                            ("bubble/step", "right"), ("sent", "right")):
        table.add_column(column, justify=justify)
    for rank, stages in rank_stages.items():
        for stage in stages:
            cells = round(stage.utilisation * BAR_CELLS)
            table.add_row(*((str(rank),) if by_rank else ()), str(stage.stage), f"{100 * stage.utilisation:.0f}%",
                          Text("█" * cells + "·" * (BAR_CELLS - cells), style="cyan"),
                          f"{1000 * stage.bubble_s:.1f} ms", bytes_rate(stage.bytes_per_s))
    return table


def parallel_renderable(ranks: Sequence[RankWindow], rank_stages: Mapping[int, Sequence[StageWindow]],
                        window_s: float = WINDOW_S, note: str = "") -> Group:
    """The panel's content: the rank table and its verdict, the stage table (each DP rank's
    stages) and a verdict per rank's pipeline."""
    parts: list[Table | Text] = []
    num_stages = max((len(stages) for stages in rank_stages.values()), default=0)
    head = Text("Parallel  ", style="bold")
    head.append(" · ".join(part for part in (f"{len(ranks)} DP ranks" if len(ranks) > 1 else "",
                                             f"{num_stages} PP stages" if num_stages > 1 else "") if part))
    parts.append(head)
    if len(ranks) > 1:
        parts.append(rank_table(ranks, window_s))
        verdict = imbalance_verdict(ranks, window_s)
        parts.append(Text("verdict: ", style="bold").append(
            verdict.text, style="bold red" if verdict.figure is not None else "green"))
    pipelines = {rank: stages for rank, stages in rank_stages.items() if len(stages) > 1}
    if pipelines:
        parts.append(stage_table(pipelines, window_s))
        for rank, stages in pipelines.items():
            label = f"verdict, rank {rank}: " if len(pipelines) > 1 else "verdict: "
            parts.append(Text(label, style="bold").append(stage_verdict(stages)))
    if note:
        parts.append(Text(note, style="italic dim"))
    return Group(*parts)


class ParallelPanel(Static):
    """The per-rank and per-stage figures; display off with one rank and one stage."""

    def update_view(self, view: EngineView) -> None:
        fold = view.parallel
        ranks, rank_stages = fold.rank_windows(), fold.rank_stage_windows()
        self.display = len(ranks) > 1 or fold.num_stages > 1
        if self.display:
            note = (f"the block map, queues and step charts show DP rank {view.dp_rank or 0}; this panel every rank "
                    "(r / R: follow another)")
            self.update(parallel_renderable(ranks, rank_stages, fold.window_s, note if len(ranks) > 1 else ""))

    def update_state(self, state: ReplicaState) -> None:
        ranks = state.rank_windows()
        self.display = len(ranks) > 1
        if self.display:
            self.update(parallel_renderable(ranks, {}, WINDOW_S, "from each rank's engine-labelled /metrics series"))
