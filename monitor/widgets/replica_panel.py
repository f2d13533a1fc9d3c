"""One replica's metrics as its /metrics shows them: queues, KV usage, throughput,
latency quantiles over the last minute, the prefix cache and the cache config, one
line per DP rank, and what this source cannot show."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from monitor.replica import LIVE, WINDOW_S, ReplicaState
from monitor.widgets.fleet_table import percent, seconds
from monitor.widgets.numbers import number
from monitor.widgets.spark import spark

LATENCIES = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e"), ("queue", "queue"))
CONFIG_KEYS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "gpu_memory_utilization", "cache_dtype",
               "enable_prefix_caching", "kv_cache_memory_bytes")
NOT_PROVIDED = ("vLLM's /metrics has no per-request queues, block tables, startup phases or step events: "
                "those panels are kvscope's alone. KV usage counts cached-but-free blocks as free.")


class ReplicaPanel(Static):
    """The metrics side of one replica's dashboard."""

    def update_state(self, state: ReplicaState) -> None:
        width = max(40, (self.size.width or 120) - 4)
        out = Table.grid(padding=(0, 2))
        out.add_column()
        if not state.engines:
            why = state.reason or "waiting for the first scrape"
            self.update(Text(f"{state.source}: {state.status}, {why}", style="bold red" if state.status != LIVE else ""))
            return
        spark_width = max(8, min(40, (width - 2) // 3 - 6))
        head = Text(f"{state.kind} · {state.model_name or 'model ?'} · {len(state.engines)} engine(s) · "
                    f"{state.scrapes} scrapes", style="bold")
        out.add_row(head)
        for label, engine in state.engines.items():
            m = engine.latest
            if m is None:
                continue
            line = Text(f"engine {label}  ", style="bold")
            line.append(f"running {number(m.running)}  waiting {number(m.waiting)}  KV {100 * m.kv_usage:.1f}%  ")
            line.append(f"gen {number(round(engine.gen_tps, 1))} tok/s  prompt {number(round(engine.prompt_tps, 1))} tok/s  ")
            line.append(f"preempt {number(round(engine.preempt_per_min, 1))}/min ({number(m.preemptions)} total)  ")
            line.append(f"finished {number(m.finished)}")
            out.add_row(line)
            trend = Text("  ")
            for key, title in (("running", "run"), ("waiting", "wait"), ("kv_pct", "KV%")):
                trend.append(f"{title} ", style="dim").append(spark(engine.series[key], spark_width), style="cyan")
                trend.append("  ")
            out.add_row(trend)
        out.add_row(self._latencies(state))
        out.add_row(self._prefix(state, spark_width))
        config = next((e.latest.cache_config for e in state.engines.values() if e.latest and e.latest.cache_config), {})
        if config:
            items = [f"{k}={config[k]}" for k in CONFIG_KEYS if k in config and config[k] != "None"]
            out.add_row(Text("cache_config_info  ", style="bold").append(" ".join(items), style="dim"))
        out.add_row(Text(NOT_PROVIDED, style="italic dim"))
        self.update(out)

    @staticmethod
    def _latencies(state: ReplicaState) -> Table:
        table = Table(title=f"latency over the last {WINDOW_S:.0f} s (from histogram buckets)", title_justify="left",
                      box=None, padding=(0, 2), show_edge=False)
        for column in ("", "p50", "p90", "p99", "count"):
            table.add_column(column, justify="right")
        for key, title in LATENCIES:
            merged = [e.latency(key) for e in state.engines.values()]
            count = sum(h.count for h in merged if h is not None)
            if not any(h is not None for h in merged):
                table.add_row(title, "not served", "", "", "")
                continue
            table.add_row(title, *(seconds(state.quantile(key, q)) for q in (0.5, 0.9, 0.99)), number(round(count)))
        return table

    @staticmethod
    def _prefix(state: ReplicaState, spark_width: int) -> Text:
        hits = sum(e.latest.prefix_hits for e in state.engines.values() if e.latest)
        queries = sum(e.latest.prefix_queries for e in state.engines.values() if e.latest)
        text = Text("prefix cache  ", style="bold")
        text.append(f"hit rate {percent(state.hit_rate())}% over the window, {number(hits)}/{number(queries)} "
                    "tokens since start ")
        text.append(spark(state.series("hit_pct"), spark_width), style="green")
        return text
