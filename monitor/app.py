"""The monitor app: one layout for live engines and recordings.

State lives in an :class:`~engine.events.folds.view.EngineView`; widgets render it. In
replay the view comes from a :class:`~monitor.state.Timeline` (seekable); live,
events from a :class:`~engine.events.feed.LiveFeed` are folded on a timer. The
monitor only reads: nothing here can change the engine.

With several data-parallel ranks the view follows one (the header names it); ``r`` / ``R``
follow the next / previous: in replay the timeline re-folds the recording for that rank
from its checkpoints, live the feed fetches the rank's snapshot from the server
(``/debug/state?dp_rank=R``) and the rank's events fold on from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Footer, TabbedContent, TabPane

from engine.events import EventBus
from engine.events.feed import BusFeed, LiveFeed
from engine.events.folds.view import EngineView
from monitor.gpu import GpuReader
from monitor.live_updates import LiveUpdates
from monitor.rank_follow import RankFollower
from monitor.replay_control import ReplayControl
from monitor.state import Timeline
from monitor.widgets.block_map import BlockMap
from monitor.widgets.blocks_pane import BlocksPane
from monitor.widgets.diagnosis import Diagnosis
from monitor.widgets.events_log import EventsLog
from monitor.widgets.expert_load import ExpertPanel
from monitor.widgets.goto_input import GotoInput
from monitor.widgets.memory_bar import MemoryBar
from monitor.widgets.parallel_panel import ParallelPanel
from monitor.widgets.queues import Queues
from monitor.widgets.replay_bar import ReplayBar
from monitor.widgets.request_panel import RequestPanel
from monitor.widgets.startup_table import StartupTable
from monitor.widgets.step_charts import StepCharts
from monitor.widgets.title_bar import TitleBar

TICK_S = 0.1
STEP_1 = Binding.Group("±1 step")
STEP_100 = Binding.Group("±100")
NEXT = Binding.Group("next preempt/arrival")
SPEED = Binding.Group("speed")
DP_RANK = Binding.Group("rank")
REPLAY_ACTIONS = {"replay", "goto"}


class MonitorApp(App[None]):
    """``MonitorApp(timeline=...)`` replays; ``MonitorApp(feed=...)`` follows a live feed."""

    CSS_PATH = "app.tcss"
    TITLE = "kvscope monitor"
    # Footer names are the keys a person presses (".", not Textual's "period"), and
    # related keys share one description, so the whole footer fits at 120 columns.
    # The replay keys name their command of monitor/replay_control.py: replay('step', 1).
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "replay('toggle_play')", "play/pause", key_display="space"),
        Binding("period", "replay('step', 1)", "±1", key_display=".", group=STEP_1),
        Binding("comma", "replay('step', -1)", "±1", key_display=",", group=STEP_1),
        Binding("right_square_bracket", "replay('step', 100)", "±100", key_display="]", group=STEP_100),
        Binding("left_square_bracket", "replay('step', -100)", "±100", key_display="[", group=STEP_100),
        Binding("g", "goto", "go to step"),
        Binding("n", "replay('next_preemption')", "next preempt/arrival", group=NEXT),
        Binding("a", "replay('next_arrival')", "next preempt/arrival", group=NEXT),
        Binding("f", "replay('faster')", "speed", group=SPEED),
        Binding("s", "replay('slower')", "speed", group=SPEED),
        Binding("r", "follow_rank(1)", "rank", group=DP_RANK),  # shown only with several DP ranks
        Binding("R", "follow_rank(-1)", "rank", group=DP_RANK),
        Binding("home", "replay('home')", "Start", show=False),
        Binding("end", "replay('end')", "End", show=False),
        Binding("1", "show('blocks')", "Blocks", show=False),
        Binding("2", "show('steps')", "Steps", show=False),
        Binding("3", "show('startup')", "Startup", show=False),
        Binding("4", "show('events')", "Events", show=False),
        Binding("5", "show('diagnosis')", "Diagnosis", show=False),
        Binding("G", "show('gpu')", "GPU", show=False),  # a screen of its own: the tab row and footer stay as they are
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, *, timeline: Timeline | None = None, feed: LiveFeed | None = None,
                 source_name: str = "", autoplay: bool = False,
                 wall_clock: Callable[[], float] = time.monotonic, gpu: GpuReader | None = None,
                 exit_when_engine_stops: bool = False) -> None:
        if (timeline is None) == (feed is None):
            raise ValueError("MonitorApp needs exactly one of timeline= or feed=")
        super().__init__()
        self.timeline = timeline
        self.feed = feed
        self.live = feed is not None
        self.source_name = source_name or (feed.description if feed else "recording")
        self.view: EngineView = timeline.view if timeline is not None else EngineView()
        self._autoplay = autoplay
        self.gpu = gpu  # NVML (monitor/gpu.py) unless a test or --gpu-readings gives another reader
        self.replay = (ReplayControl(timeline, self.refresh_view, self.update_bars,
                                     lambda text: self.notify(text, timeout=2), wall_clock)
                       if timeline is not None else None)
        self.updates = (LiveUpdates(self, feed, wall_clock, exit_when_engine_stops)
                        if feed is not None else None)
        self.ranks = RankFollower(timeline, feed, lambda: self.view, self.refresh_view, self.update_bars,
                                  lambda text: self.notify(text, severity="warning", timeout=6))

    @property
    def playing(self) -> bool:
        return self.replay is not None and self.replay.playing

    @property
    def speed(self) -> float:
        return self.replay.speed if self.replay is not None else 10.0

    @property
    def asked_rank(self) -> int | None:
        """Live: the DP rank whose snapshot the feed is fetching."""
        return self.ranks.asked

    def compose(self) -> ComposeResult:
        yield TitleBar(id="title")
        yield MemoryBar(id="memory")
        with TabbedContent(initial="blocks"):
            with TabPane("Blocks [1]", id="blocks"):
                yield BlocksPane(id="blocks-pane")
            with TabPane("Steps [2]", id="steps"):
                yield ParallelPanel(id="parallel")  # shown only with several DP ranks or PP stages
                yield StepCharts(id="charts")
                yield ExpertPanel(id="experts")  # shown only for a MoE model
            with TabPane("Startup [3]", id="startup"):
                yield StartupTable(id="startup-table")
            with TabPane("Events [4]", id="events"):
                yield EventsLog(id="events-log")
            with TabPane("Diagnosis [5]", id="diagnosis"), VerticalScroll():
                yield Diagnosis(id="diagnosis-panel")
        yield GotoInput(self.seek_index, id="goto")
        yield ReplayBar(id="replay-bar")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        if self.updates is not None:
            self.updates.feed.start()
            self.set_interval(TICK_S, self.updates.tick)
        if self.replay is not None:
            self.set_interval(TICK_S, self.replay.tick)
            self.replay.set_playing(self._autoplay)
        self.query_one(BlockMap).focus()
        self.refresh_view()

    def on_unmount(self) -> None:
        if self.updates is not None:
            self.updates.feed.stop()

    def engine_now(self) -> float:
        """The engine's clock as the dashboard shows it. Replay: the recording's time
        (the latest folded event's ``t``). Live: that time moving on between events
        (monitor/live_updates.py)."""
        return self.updates.engine_now(self.view.t) if self.updates is not None else self.view.t

    # ------------------------------------------------------------------ render
    def refresh_view(self, view: EngineView | None = None) -> None:
        """Every panel redrawn from ``view`` (shown from now on), or from the view shown."""
        if view is not None:
            self.view = view
        view = self.view
        if self.updates is not None:
            self.updates.mark_rendered()
        self.query_one(BlockMap).update_view(view)
        self.query_one(MemoryBar).update_view(view)
        self.query_one(Queues).update_view(view, self.engine_now())
        self.query_one(StepCharts).update_view(view)
        self.query_one(ExpertPanel).update_view(view)
        self.query_one(ParallelPanel).update_view(view)
        self.query_one(StartupTable).update_view(view, self.engine_now())
        self.query_one(EventsLog).update_view(view)
        tl = self.timeline
        if tl is not None:  # live, LiveUpdates hands the panel the events it drains
            end = tl.step_positions[tl.position] + 1 if tl.step_positions else len(tl.events)
            self.query_one(Diagnosis).show_until(tl.events, end)
            self.query_one(RequestPanel).show_until(tl.events, end)
        self.update_bars()

    def update_bars(self) -> None:
        """The header and the replay bar; the footer's r / R when live ranks appear."""
        tl = self.timeline
        connection = self.feed.connection if self.feed is not None else None
        if self.ranks.ranks_changed():
            self.refresh_bindings()
        self.query_one(TitleBar).show(self.source_name, connection, self.view.failed_sinks, self.view.engine_error,
                                      followed=self.followed_rank_text(), stalled=self.view.stalled)
        self.query_one(ReplayBar).show(
            source=self.source_name, step=self.view.step, position=tl.position if tl else 0,
            length=len(tl) if tl else 0, playing=self.playing, speed=self.speed, live=self.live,
            connection=connection, now=self.engine_now(),
        )

    # ----------------------------------------------------------------- replay
    def seek(self, position: int) -> None:
        """Show the recording at step position ``position`` (clamped)."""
        if self.replay is not None:
            self.replay.seek(position)

    def seek_index(self, index: int) -> None:
        """Show the recording at the first step whose ``index`` is ≥ ``index``."""
        if self.replay is not None:
            self.replay.seek_index(index)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "follow_rank":
            return len(self.dp_ranks()) > 1
        return not (action in REPLAY_ACTIONS and self.live)

    def action_replay(self, command: str, *amount: int) -> None:
        """A replay key: ``command`` of :class:`~monitor.replay_control.ReplayControl`."""
        if self.replay is not None:
            self.replay.commands[command](*amount)

    def action_goto(self) -> None:
        self.query_one(GotoInput).ask()

    def on_key(self, event: events.Key) -> None:
        # Esc closes the step prompt wherever the focus went since it opened.
        if event.key == "escape" and (goto := self.query_one(GotoInput)).has_class("visible"):
            goto.cancel()

    # ----------------------------------------------------------------- DP ranks
    def dp_ranks(self) -> list[int]:
        return self.ranks.ranks()

    def followed_rank_text(self) -> str:
        return self.ranks.text()

    def action_follow_rank(self, delta: int) -> None:
        """Follow the next (``delta`` 1) or previous (-1) DP rank."""
        self.ranks.follow(delta)

    # ----------------------------------------------------------------- tabs and screens
    def action_show(self, what: str) -> None:
        """A tab by its id, or ``gpu``: the GPU screen, a screen of its own over the tabs."""
        if what != "gpu":
            self.query_one(TabbedContent).active = what
            return
        from monitor.gpu import NvmlReader
        from monitor.gpu_screen import GpuScreen

        self.push_screen(GpuScreen(self.gpu or NvmlReader(), lambda: self.view, replay=not self.live))


def run_live(bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None = None,
             title: str = "in-process engine") -> None:
    """Run the dashboard in this terminal on a live in-process bus; blocks until
    the user quits. Call it from the main thread while the engine steps on
    another thread (the bus delivers on the engine thread; the app only queues)."""
    MonitorApp(feed=BusFeed(bus, snapshot_fn), source_name=title).run()


def run_replay(timeline: Timeline, source_name: str = "recording", autoplay: bool = False) -> None:
    MonitorApp(timeline=timeline, source_name=source_name, autoplay=autoplay).run()
