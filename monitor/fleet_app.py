"""The fleet dashboard: replicas polled over /metrics (vLLM or kvscope, mixed), one row
each, Enter into one replica's dashboard; live or from a ``monitor record`` recording.

The app only renders :class:`~monitor.replica.ReplicaState` (folded from the feed's
events on a timer, or taken from a :class:`~monitor.external.ReplicaTimeline`) and
the GPU reader's snapshots. Enter on a kvscope replica ends the app with its URL
(``exit`` result), so the command opens kvscope's own full dashboard on its
``/events`` stream and comes back to the fleet after it; a vLLM replica opens
:class:`ReplicaScreen` (metrics, cached prefixes, GPU) in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from monitor.external import ExternalFeed, ReplicaTimeline, fold_into
from monitor.gpu import GpuReader
from monitor.playback import PlaybackClock
from monitor.poller import KVSCOPE
from monitor.replica import LIVE, ReplicaState
from monitor.widgets.fleet_table import FleetSummary, FleetTable
from monitor.widgets.gpu_panel import GpuPanel, no_ledger
from monitor.widgets.parallel_panel import ParallelPanel
from monitor.widgets.prefix_map import PrefixMap
from monitor.widgets.replica_panel import ReplicaPanel
from monitor.widgets.title_bar import middle_cut

TICK_S = 0.25
# Live screens redraw at most this often: eight replicas' scrapes arrive spread over each second,
# and a redraw per arrival was most of the fleet view's CPU.
REFRESH_S = 1.0
PLAY_SPEED = 10.0  # recorded seconds per second of replay (kvscope's replay starts at 10 steps/s)


class ReplicaScreen(Screen[None]):
    """One replica's dashboard from outside: its metrics, its cached prefixes, the GPUs."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.fleet", "fleet"),
                                              Binding("q", "app.quit", "quit")]

    def __init__(self, source: str, gpu: GpuReader | None = None, kind: str = "") -> None:
        super().__init__()
        self.source = source
        self.gpu = gpu
        self.ledger_why = "kvscope's own dashboard has it" if kind == KVSCOPE else "vLLM's /metrics carries none"

    def compose(self) -> ComposeResult:
        yield Static("", id="replica-title", classes="title")
        with VerticalScroll():  # at 120x40 the GPU devices lie below the fold
            yield ReplicaPanel(id="replica-panel")
            yield ParallelPanel(id="replica-parallel")  # shown only with several DP ranks (engine labels)
            yield PrefixMap(id="prefix-map")
            yield GpuPanel(self.gpu, no_ledger(self.ledger_why), id="replica-gpu")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        if isinstance(self.app, FleetApp):
            self.app.refresh_screens()


class FleetApp(App[str | None]):
    """``FleetApp(states, feed=...)`` live; ``FleetApp(states, timeline=...)`` replays.
    ``detail`` opens that replica's screen at once (``monitor vllm URL``)."""

    CSS = """
    .title { height: 1; background: $primary-background; padding: 0 1; }
    FleetTable { height: auto; max-height: 60%; }
    FleetSummary { height: auto; padding: 0 1; }
    GpuPanel { height: auto; padding: 0 1; }
    ReplicaPanel { height: auto; padding: 0 1; }
    ParallelPanel { height: auto; padding: 0 1; }
    PrefixMap { height: auto; padding: 0 1; }
    #fleet-note { height: auto; padding: 0 1; color: $text-muted; }
    """
    TITLE = "kvscope monitor"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_play", "play/pause", key_display="space"),
        Binding("period", "step(1)", "±1 scrape", key_display="."),
        Binding("comma", "step(-1)", "±1 scrape", key_display=",", show=False),
        # priority: the fleet table would take home/end to scroll itself
        Binding("home", "seek_to(0)", "start", show=False, priority=True),
        Binding("end", "seek_to(-1)", "end", show=False, priority=True),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, sources: list[str] | None = None, *, feed: ExternalFeed | None = None,
                 timeline: ReplicaTimeline | None = None, gpu: GpuReader | None = None, detail: str | None = None,
                 states: dict[str, ReplicaState] | None = None, kinds: dict[str, str] | None = None,
                 source_name: str = "", refresh_s: float = REFRESH_S,
                 wall_clock: Callable[[], float] = time.monotonic) -> None:
        if (feed is None) == (timeline is None):
            raise ValueError("FleetApp needs exactly one of feed= or timeline=")
        super().__init__()
        self.feed = feed
        self.timeline = timeline
        names = sources or (feed.urls if feed is not None else timeline.sources if timeline is not None else [])
        self.states: dict[str, ReplicaState] = states if states is not None else (
            timeline.states if timeline is not None else {s: ReplicaState(source=s) for s in names})
        for source, kind in (kinds or {}).items():
            if source in self.states:
                self.states[source].kind = kind
        self.gpu = gpu
        self.detail = detail
        self.refresh_s = refresh_s
        self._wall_clock = wall_clock
        self._dirty = False  # live: folded events not drawn yet
        self._drawn_at = 0.0
        self.playing = False  # replay: advancing through the recording at PLAY_SPEED times its pace
        self._play_t = 0.0  # where the replay has played to, in recorded seconds
        self._playback = PlaybackClock(wall_clock)
        if not self.states:
            raise ValueError("FleetApp needs at least one source")
        self.source_name = source_name or (f"fleet of {len(self.states)}" if len(self.states) > 1 else names[0])

    @property
    def live(self) -> bool:
        return self.feed is not None

    def compose(self) -> ComposeResult:
        yield Static("", id="fleet-title", classes="title")
        yield FleetTable(id="fleet")
        yield FleetSummary(id="fleet-summary")
        yield Static("", id="fleet-note")
        yield GpuPanel(self.gpu, no_ledger("a fleet has one per replica: open a kvscope one"), id="fleet-gpu")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        if self.feed is not None:
            self.feed.start()
        self.set_interval(TICK_S, self._tick)
        self.query_one(FleetTable).focus()
        self.refresh_screens()
        if self.detail is not None:
            self._open_screen(self.detail)

    async def on_unmount(self) -> None:
        if self.feed is not None:
            await self.feed.stop()

    # ------------------------------------------------------------------- data
    def _tick(self) -> None:
        if self.feed is not None:
            self._dirty = fold_into(self.states, self.feed.drain()) or self._dirty
            now = self._wall_clock()
            if self._dirty and now - self._drawn_at >= self.refresh_s:
                self._dirty, self._drawn_at = False, now
                self.refresh_screens()
        elif self.playing and self.timeline is not None:
            # PLAY_SPEED times the recording's own pace: recorded seconds per second of the clock.
            self._play_t = max(self._play_t, self.timeline.t) + self._playback.elapsed() * PLAY_SPEED
            target = self.timeline.position_at(self._play_t)
            if self.timeline.position >= len(self.timeline) - 1:
                self.playing = False
            elif target > self.timeline.position:
                self._show(target)

    def _open_screen(self, source: str) -> None:
        kind = self.states[source].kind if source in self.states else ""
        self.push_screen(ReplicaScreen(source, self.gpu, kind))

    # ----------------------------------------------------------------- render
    def _title(self) -> Text:
        states = list(self.states.values())
        live = sum(1 for s in states if s.status == LIVE)
        text = Text(f"kvscope monitor · {middle_cut(self.source_name, 60)}  ")
        if self.timeline is not None:
            text.append(f"{'▶ playing' if self.playing else '⏸ replay'} scrape {self.timeline.position + 1}/"
                        f"{len(self.timeline)} · t={self.timeline.t:.1f} s", style="bold cyan")
        else:
            text.append(f"● {live}/{len(states)} live", style="bold green" if live == len(states) else "bold yellow")
        stalled = [s.source for s in states if s.stall_text()]
        if stalled:
            text.append(f"  ⏸ STALLED {', '.join(middle_cut(s, 30) for s in stalled)}", style="bold red")
        return text

    def refresh_screens(self) -> None:
        if not self.screen_stack:  # a tick while the app starts or closes: no screen to draw on
            return
        states = list(self.states.values())
        screen = self.screen
        if isinstance(screen, ReplicaScreen):
            state = self.states.get(screen.source)
            if state is None or not screen.query("#replica-title"):
                return  # pushed but not composed yet: its on_mount draws it
            screen.query_one("#replica-title", Static).update(
                Text(f"kvscope monitor · {middle_cut(state.source, 60)} · {state.kind} · {state.status}"
                     + (f" ({state.reason})" if state.reason else "")).append(state.stall_text(), style="bold red")
                .append("   Esc: fleet", style="dim"))
            screen.query_one(ReplicaPanel).update_state(state)
            screen.query_one(ParallelPanel).update_state(state)
            kv_source = self.feed.kv_sources.get(state.source) if self.feed is not None else (
                "recorded" if state.kv_batches else None)
            screen.query_one(PrefixMap).update_state(state, kv_source)
            return
        if not screen.query("#fleet"):
            return
        screen.query_one("#fleet-title", Static).update(self._title())
        screen.query_one(FleetTable).update_states(states)
        screen.query_one(FleetSummary).update_states(states)
        screen.query_one("#fleet-note", Static).update(
            Text("Enter: a replica's dashboard (kvscope: its own full dashboard) · K kvscope, V vLLM · "
                 "a DP rank (vLLM's engine label) is a row of its own", style="dim"))

    def action_fleet(self) -> None:
        """From a replica's screen back to the fleet, drawn at once (a replay has no tick to wait for)."""
        self.pop_screen()
        self.refresh_screens()

    # ---------------------------------------------------------------- actions
    def action_open(self) -> None:
        table = self.query_one(FleetTable)
        if table.row_count == 0:
            return
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value or ""
        source = key.split("#engine=", 1)[0]
        state = self.states.get(source)
        if state is None:
            return
        if state.kind == KVSCOPE and self.live:
            self.exit(source)
        else:
            self._open_screen(source)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("step", "seek_to", "toggle_play"):
            return self.timeline is not None
        return True

    def action_toggle_play(self) -> None:
        self.playing = not self.playing
        if self.playing and self.timeline is not None:
            self._play_t = self.timeline.t
            self._playback.start()

    def action_step(self, delta: int) -> None:
        if self.timeline is not None:
            self._show(self.timeline.position + delta)

    def action_seek_to(self, position: int) -> None:
        if self.timeline is not None:
            self._show(position if position >= 0 else len(self.timeline) - 1)

    def seek(self, position: int) -> None:
        """Show the recording at scrape ``position`` (clamped)."""
        self._show(position)

    def _show(self, position: int) -> None:
        assert self.timeline is not None
        states = self.timeline.seek(position)
        for source, state in states.items():
            state.kind = self.states[source].kind if source in self.states else state.kind
        self.states = states
        self.refresh_screens()
