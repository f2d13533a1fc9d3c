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

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widgets import Footer, Input, Label, TabbedContent, TabPane

from engine.events import EngineStopped, Event, EventBus, LogEvent
from engine.events.feed import LIVE, BusFeed, LiveFeed
from engine.events.folds.view import EngineView
from monitor.gpu import GpuReader
from monitor.playback import PlaybackClock
from monitor.state import Timeline
from monitor.widgets.block_map import BlockMap
from monitor.widgets.diagnosis import Diagnosis
from monitor.widgets.events_log import EventsLog
from monitor.widgets.expert_load import ExpertPanel
from monitor.widgets.memory_bar import MemoryBar
from monitor.widgets.parallel_panel import ParallelPanel
from monitor.widgets.queues import Queues
from monitor.widgets.replay_bar import ReplayBar
from monitor.widgets.request_panel import RequestPanel
from monitor.widgets.startup_table import StartupTable
from monitor.widgets.step_charts import StepCharts
from monitor.widgets.title_bar import TitleBar

SPEEDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
TICK_S = 0.1
CLOCK_REFRESH_S = 0.5  # how often queue ages move between events
STEP_1 = Binding.Group("±1 step")
STEP_100 = Binding.Group("±100")
NEXT = Binding.Group("next preempt/arrival")
SPEED = Binding.Group("speed")
DP_RANK = Binding.Group("rank")
REPLAY_ACTIONS = {"toggle_play", "step", "goto", "next_preemption", "next_arrival", "faster", "slower", "home", "end"}


class MonitorApp(App[None]):
    """``MonitorApp(timeline=...)`` replays; ``MonitorApp(feed=...)`` follows a live feed."""

    CSS_PATH = "app.tcss"
    TITLE = "kvscope monitor"
    # Footer names are the keys a person presses (".", not Textual's "period"), and
    # related keys share one description, so the whole footer fits at 120 columns.
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_play", "play/pause", key_display="space"),
        Binding("period", "step(1)", "±1", key_display=".", group=STEP_1),
        Binding("comma", "step(-1)", "±1", key_display=",", group=STEP_1),
        Binding("right_square_bracket", "step(100)", "±100", key_display="]", group=STEP_100),
        Binding("left_square_bracket", "step(-100)", "±100", key_display="[", group=STEP_100),
        Binding("g", "goto", "go to step"),
        Binding("n", "next_preemption", "next preempt/arrival", group=NEXT),
        Binding("a", "next_arrival", "next preempt/arrival", group=NEXT),
        Binding("f", "faster", "speed", group=SPEED),
        Binding("s", "slower", "speed", group=SPEED),
        Binding("r", "follow_rank(1)", "rank", group=DP_RANK),  # shown only with several DP ranks
        Binding("R", "follow_rank(-1)", "rank", group=DP_RANK),
        Binding("home", "home", "Start", show=False),
        Binding("end", "end", "End", show=False),
        Binding("1", "show_tab('blocks')", "Blocks", show=False),
        Binding("2", "show_tab('steps')", "Steps", show=False),
        Binding("3", "show_tab('startup')", "Startup", show=False),
        Binding("4", "show_tab('events')", "Events", show=False),
        Binding("5", "show_tab('diagnosis')", "Diagnosis", show=False),
        Binding("G", "gpu", "GPU", show=False),  # a screen of its own: the tab row and footer stay as they are
        Binding("q", "quit", "quit"),
    ]

    playing: reactive[bool] = reactive(False)
    speed: reactive[float] = reactive(10.0)

    def __init__(self, *, timeline: Timeline | None = None, feed: LiveFeed | None = None,
                 source_name: str = "", autoplay: bool = False,
                 wall_clock: Callable[[], float] = time.monotonic, gpu: GpuReader | None = None,
                 exit_when_engine_stops: bool = False) -> None:
        if (timeline is None) == (feed is None):
            raise ValueError("MonitorApp needs exactly one of timeline= or feed=")
        super().__init__()
        self.timeline = timeline
        self.feed = feed
        self.source_name = source_name or (feed.description if feed else "recording")
        self.view: EngineView = timeline.view if timeline is not None else EngineView()
        self._autoplay = autoplay
        self._budget = 0.0  # fractional steps owed to the player
        self._wall_clock = wall_clock
        self._playback = PlaybackClock(wall_clock)  # replay moves by the clock's seconds, not by ticks
        self._clock_anchor: tuple[float, float] | None = None  # (view.t, wall clock when it arrived)
        self._clock_rendered = 0.0  # wall clock of the last render of clock-driven cells
        self.gpu = gpu  # NVML (monitor/gpu.py) unless a test or --gpu-readings gives another reader
        # In-process (`engine serve --monitor`): the engine thread's death ends the dashboard,
        # so the command can exit non-zero and a supervisor restart it.
        self.exit_when_engine_stops = exit_when_engine_stops
        self.asked_rank: int | None = None  # live: the DP rank whose snapshot the feed is fetching
        self._num_ranks = 0  # the DP ranks the footer's r / R were last shown for

    @property
    def live(self) -> bool:
        return self.feed is not None

    def compose(self) -> ComposeResult:
        yield TitleBar(id="title")
        yield MemoryBar(id="memory")
        with TabbedContent(initial="blocks"):
            with TabPane("Blocks [1]", id="blocks"), Vertical(id="blocks-pane"):
                with Vertical(id="blockmap-column"):
                    yield Label("", id="blockmap-legend")
                    yield BlockMap(id="blockmap")
                yield Queues(id="queues")
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
        yield Input(placeholder="go to step index, Enter to jump, Esc to cancel", id="goto", type="integer")
        yield ReplayBar(id="replay-bar")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        if self.feed is not None:
            self.feed.start()
        self.set_interval(TICK_S, self._tick)
        self.playing = self._autoplay and not self.live
        self.query_one("#goto", Input).disabled = True  # only takes keys while asked for a step
        self.query_one(BlockMap).focus()
        self.refresh_view()

    def on_unmount(self) -> None:
        if self.feed is not None:
            self.feed.stop()

    # ------------------------------------------------------------------- clock
    def engine_now(self) -> float:
        """The engine's clock as the dashboard shows it. Replay: the recording's time
        (the latest folded event's ``t``). Live: that time plus the wall time since
        the event arrived, so ages keep moving through a long step; frozen while the
        feed is not live (the engine's time is unknown then)."""
        view_t = self.view.t
        anchor = self._clock_anchor
        if self.feed is None or self.feed.connection.state != LIVE or anchor is None or anchor[0] != view_t:
            return view_t
        return view_t + max(0.0, self._wall_clock() - anchor[1])

    # ------------------------------------------------------------------ render
    def refresh_view(self) -> None:
        view = self.view
        self._clock_rendered = self._wall_clock()
        self.query_one(BlockMap).update_view(view)
        self.query_one(MemoryBar).update_view(view)
        self.query_one(Queues).update_view(view, self.engine_now())
        self.query_one(StepCharts).update_view(view)
        self.query_one(ExpertPanel).update_view(view)
        self.query_one(ParallelPanel).update_view(view)
        self.query_one(StartupTable).update_view(view, self.engine_now())
        self.query_one(EventsLog).update_view(view)
        tl = self.timeline
        if tl is not None:  # live, _tick hands the panel the events it drains
            end = tl.step_positions[tl.position] + 1 if tl.step_positions else len(tl.events)
            self.query_one(Diagnosis).show_until(tl.events, end)
            self.query_one(RequestPanel).show_until(tl.events, end)
        self._update_bar()

    def dp_ranks(self) -> list[int]:
        """The data-parallel ranks there are to follow: the recording's, or live those the
        view's Parallel fold has seen (a DP server's snapshot seeds every rank)."""
        if self.timeline is not None:
            return self.timeline.ranks
        return sorted(set(self.view.parallel.ranks) | ({self.view.dp_rank} if self.view.dp_rank is not None else set()))

    def followed_rank_text(self) -> str:
        """``DP rank 1 of 2`` (live, while another rank's state is on its way: ``→ 0``); "" with one rank."""
        ranks = self.dp_ranks()
        if len(ranks) < 2:
            return ""
        text = f"DP rank {self.view.dp_rank or 0} of {len(ranks)}"
        return text + (f" → {self.asked_rank}" if self.asked_rank is not None else "")

    def _update_bar(self) -> None:
        tl = self.timeline
        connection = self.feed.connection if self.feed is not None else None
        if len(self.dp_ranks()) != self._num_ranks:  # live ranks appear: r / R join the footer
            self._num_ranks = len(self.dp_ranks())
            self.refresh_bindings()
        self.query_one(TitleBar).show(self.source_name, connection, self.view.failed_sinks, self.view.engine_error,
                                      followed=self.followed_rank_text(), stalled=self.view.stalled)
        self.query_one(ReplayBar).show(
            source=self.source_name, step=self.view.step, position=tl.position if tl else 0,
            length=len(tl) if tl else 0, playing=self.playing, speed=self.speed, live=self.live,
            connection=connection, now=self.engine_now(),
        )

    def _tick(self) -> None:
        if self.feed is not None:
            events = self.feed.drain()
            if self.exit_when_engine_stops and any(isinstance(e, EngineStopped) for e in events):
                self.exit(return_code=1)
                return
            try:
                if events:
                    self.view.fold(events)
                    self._follow_answered(events)
                    self.query_one(Diagnosis).fold(events)
                    self.query_one(RequestPanel).fold(events)
                    if self._clock_anchor is None or self._clock_anchor[0] != self.view.t:
                        self._clock_anchor = (self.view.t, self._wall_clock())
                    self.refresh_view()
                else:
                    # The connection, a retry's countdown and the engine clock move without events.
                    self._update_bar()
                    if self._wall_clock() - self._clock_rendered >= CLOCK_REFRESH_S:
                        self._clock_rendered = self._wall_clock()
                        now = self.engine_now()
                        self.query_one(Queues).update_view(self.view, now)
                        self.query_one(StartupTable).update_view(self.view, now)
            except NoMatches:  # a tick that lands while the screen is torn down
                return
        elif self.playing and self.timeline is not None:
            self._budget += self.speed * self._playback.elapsed()
            steps = int(self._budget)
            if steps:
                self._budget -= steps
                self.move(steps)
                if self.timeline.position >= len(self.timeline) - 1:
                    self.playing = False

    # ----------------------------------------------------------------- replay
    def seek(self, position: int) -> None:
        """Show the recording at step position ``position`` (clamped)."""
        if self.timeline is None:
            return
        self.view = self.timeline.seek(position)
        self.refresh_view()

    def seek_index(self, index: int) -> None:
        """Show the recording at the first step whose ``index`` is ≥ ``index``."""
        if self.timeline is not None:
            self.seek(self.timeline.position_of_index(index))

    def move(self, delta: int) -> None:
        tl = self.timeline
        if tl is None:
            return
        if 0 < delta <= 20:  # short hops fold forward instead of restoring a checkpoint
            for _ in range(delta):
                tl.step_forward()
            self.view = tl.view
            self.refresh_view()
        else:
            self.seek(tl.position + delta)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "follow_rank":
            return len(self.dp_ranks()) > 1
        return not (action in REPLAY_ACTIONS and self.live)

    # ----------------------------------------------------------------- DP ranks
    def action_follow_rank(self, delta: int) -> None:
        """Follow the next (``delta`` 1) or previous (-1) DP rank."""
        ranks = self.dp_ranks()
        if len(ranks) < 2:
            return
        current = self.asked_rank if self.asked_rank is not None else self.view.dp_rank
        rank = ranks[(ranks.index(current) + delta) % len(ranks)] if current in ranks else ranks[0]
        if self.timeline is not None:
            self.view = self.timeline.follow(rank)
            self.refresh_view()
            return
        assert self.feed is not None
        why_not = self.feed.follow_rank(rank)
        if why_not is not None:
            self.notify(f"cannot follow DP rank {rank}: {why_not}", severity="warning", timeout=6)
            return
        self.asked_rank = rank
        self._update_bar()

    def _follow_answered(self, events: list[Event]) -> None:
        """Live: the asked rank's snapshot arrived (the view follows it), or the feed said why not."""
        if self.asked_rank is None:
            return
        for event in events:
            if isinstance(event, LogEvent) and event.data.get("follow_dp_rank") == self.asked_rank:
                self.notify(event.message, severity="warning", timeout=6)
                self.asked_rank = None
                return
        if self.view.dp_rank == self.asked_rank:
            self.asked_rank = None

    def watch_playing(self, playing: bool) -> None:
        if playing:
            self._playback.start()
        if self.is_mounted:
            self._update_bar()

    def watch_speed(self) -> None:
        if self.is_mounted:
            self._update_bar()

    def action_toggle_play(self) -> None:
        self.playing = not self.playing

    def action_step(self, delta: int) -> None:
        self.playing = False
        self.move(delta)

    def action_home(self) -> None:
        self.seek(0)

    def action_end(self) -> None:
        if self.timeline is not None:
            self.seek(len(self.timeline) - 1)

    def action_next_preemption(self) -> None:
        target = self.timeline.next_preemption() if self.timeline else None
        if target is None:
            self.notify("no later preemption", timeout=2)
        else:
            self.seek(target)

    def action_next_arrival(self) -> None:
        target = self.timeline.next_arrival() if self.timeline else None
        if target is None:
            self.notify("no later arrival", timeout=2)
        else:
            self.seek(target)

    def action_faster(self) -> None:
        self.speed = next((s for s in SPEEDS if s > self.speed), SPEEDS[-1])

    def action_slower(self) -> None:
        self.speed = next((s for s in reversed(SPEEDS) if s < self.speed), SPEEDS[0])

    def action_goto(self) -> None:
        goto = self.query_one("#goto", Input)
        goto.disabled = False
        goto.add_class("visible")
        goto.value = ""
        goto.focus()

    def action_gpu(self) -> None:
        from monitor.gpu import NvmlReader
        from monitor.gpu_screen import GpuScreen

        self.push_screen(GpuScreen(self.gpu or NvmlReader(), lambda: self.view, replay=not self.live))

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    @on(Input.Submitted, "#goto")
    def _goto_submitted(self, event: Input.Submitted) -> None:
        self._hide_goto()
        if event.value.strip().lstrip("-").isdigit():
            self.seek_index(int(event.value))

    def _hide_goto(self) -> None:
        goto = self.query_one("#goto", Input)
        goto.remove_class("visible")
        goto.disabled = True
        self.query_one(BlockMap).focus()

    def on_key(self, event: Any) -> None:
        if event.key == "escape" and self.query_one("#goto", Input).has_class("visible"):
            self._hide_goto()

    @on(BlockMap.LegendChanged)
    def _legend_changed(self, message: BlockMap.LegendChanged) -> None:
        for legend in self.query("#blockmap-legend").results(Label):
            legend.update(message.legend)

    @on(Queues.RequestPicked)
    def _pick_request(self, message: Queues.RequestPicked) -> None:
        """The request panel shows the picked request's life (picked again: closed); its
        blocks stay lit in the map."""
        panel = self.query_one(RequestPanel)
        panel.select(None if message.request_id == panel.request_id else message.request_id)
        for block_map in self.query(BlockMap):
            block_map.selected = message.request_id

    @on(Queues.RequestSelected)
    def _select_request(self, message: Queues.RequestSelected) -> None:
        # A selection can arrive while the screen is being torn down; nothing to highlight then.
        for block_map in self.query(BlockMap):
            block_map.selected = message.request_id


def run_live(bus: EventBus, snapshot_fn: Callable[[], dict[str, Any]] | None = None,
             title: str = "in-process engine") -> None:
    """Run the dashboard in this terminal on a live in-process bus; blocks until
    the user quits. Call it from the main thread while the engine steps on
    another thread (the bus delivers on the engine thread; the app only queues)."""
    MonitorApp(feed=BusFeed(bus, snapshot_fn), source_name=title).run()


def run_replay(timeline: Timeline, source_name: str = "recording", autoplay: bool = False) -> None:
    MonitorApp(timeline=timeline, source_name=source_name, autoplay=autoplay).run()
