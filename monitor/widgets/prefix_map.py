"""The map of cached prefixes a vLLM replica's KV events describe.

vLLM's events name blocks by hash, not by physical block id, so this is not the
block map: each bar is one cached prefix tree (its root block's hash, the blocks
cached under it, its deepest chain, how many chains end in it), with the store and
remove rates and how long removed blocks had stayed cached."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from monitor.replica import ReplicaState
from monitor.widgets.numbers import number
from monitor.widgets.spark import spark

NOTE = ("vLLM's KV events carry block hashes, not block ids: this is a map of cached prefixes "
        "(one bar per prefix tree), not of physical blocks.")


def short_hash(value: int | str) -> str:
    text = f"{value:016x}" if isinstance(value, int) else str(value)
    return text[:8]


class PrefixMap(Static):
    """Cached prefixes from the KV-event stream, or why there are none."""

    def update_state(self, state: ReplicaState, kv_source: str | None, rows: int = 12) -> None:
        width = max(40, (self.size.width or 120) - 4)
        text = Text("Cached prefixes  ", style="bold")
        if kv_source is None:
            text.append("no KV-event stream: pass --kv-events tcp://HOST:5557 (vLLM's --kv-events-config endpoint)",
                        style="dim")
            self.update(text)
            return
        prefix = state.prefix
        text.append(f"{kv_source} · {number(state.kv_batches)} batches, {number(state.kv_events)} events\n", style="dim")
        text.append(NOTE + "\n", style="italic dim")
        media = ", ".join(f"{n} {medium}" for medium, n in sorted(prefix.by_medium().items())) or "none"
        text.append(f"cached {number(len(prefix.blocks))} blocks ({media})"
                    + (f" of {prefix.block_size} tokens" if prefix.block_size else ""))
        text.append(f" · stored {number(prefix.stored_total)} · removed {number(prefix.removed_total)}")
        if prefix.cleared_total:
            text.append(f" · cleared {prefix.cleared_total}×")
        if prefix.unknown_removed:
            text.append(f" · {prefix.unknown_removed} removals of unseen blocks (missed events)", style="yellow")
        p50, p90 = prefix.residency_quantile(0.5), prefix.residency_quantile(0.9)
        text.append("\nresidency of removed blocks ")
        text.append(f"p50 {p50:.1f} s, p90 {p90:.1f} s" if p50 is not None and p90 is not None else "– (none removed yet)")
        spark_width = max(8, min(40, width - 60))
        for key, title in (("stored_per_s", "stored/s"), ("removed_per_s", "removed/s"), ("cached", "cached")):
            series = state.kv_series[key]
            now = series[-1] if series else 0.0
            text.append(f"\n{title:>10} {number(round(now, 1)):>7} ")
            text.append(spark(series, spark_width), style="magenta")
        trees = prefix.prefixes()
        if not trees:
            text.append("\n(no cached blocks reported yet)", style="dim")
            self.update(text)
            return
        biggest = trees[0].blocks
        bar_width = max(10, width - 52)
        text.append(f"\n{len(trees)} prefix trees, largest first:")
        for tree in trees[:rows]:
            filled = max(1, round(tree.blocks / biggest * bar_width))
            text.append(f"\n {short_hash(tree.root)} ")
            text.append("█" * filled, style="green")
            text.append(" " * (bar_width - filled))
            text.append(f" {tree.blocks:>5} blk  depth {tree.depth:>3}  {tree.leaves:>3} chains")
        if len(trees) > rows:
            text.append(f"\n … {len(trees) - rows} more", style="dim")
        self.update(text)
