"""Expert load of a mixture-of-experts model: per MoE layer, a bar per expert (the tokens the
router sent it over the view's window of steps, ``engine.events.folds.expert_load``) and the
layer's imbalance (max / mean), with the hottest expert named. Hidden for dense models
(their step events carry no expert counts)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from engine.events.folds.expert_load import ExpertLoad
from engine.events.folds.view import EngineView
from monitor.widgets.spark import BARS

LABEL_WIDTH = 13  # "L 47  x1.93 " before the bars
HOT_IMBALANCE = 2.0  # a layer at or above this max/mean is drawn in red (the doctor's threshold too)
MAX_LAYERS = 12  # layer lines shown (the most imbalanced when there are more)


def _binned(row: list[int], width: int) -> list[int]:
    """``row`` in at most ``width`` cells, each the largest count of the experts it covers
    (a hot expert stays visible when experts outnumber the columns)."""
    if len(row) <= width:
        return row
    per = -(-len(row) // width)
    return [max(row[i:i + per]) for i in range(0, len(row), per)]


def expert_lines(load: ExpertLoad, width: int, max_layers: int) -> list[Text]:
    """The panel's lines: a summary, then one line per MoE layer (the most imbalanced first
    when they do not all fit), bars scaled to the window's busiest expert anywhere."""
    if not load.num_layers:
        return []
    hot = load.hot_expert()
    head = Text("Experts  ", style="bold")
    head.append(f"{load.num_layers} MoE layers x {load.num_experts} experts, last {load.steps_in_window} steps: ")
    if hot is None:
        head.append("nothing routed yet", style="dim")
        return [head]
    head.append(f"imbalance x{hot.imbalance:.2f}", style="bold red" if hot.imbalance >= HOT_IMBALANCE else "bold")
    head.append(f" (max/mean, layer {hot.layer}); expert {hot.expert} takes {hot.share:.1%} of its tokens, "
                f"{hot.even_share:.1%} if even")
    lines = [head]
    top = max(max(row) for row in load.totals) or 1
    layers = list(range(load.num_layers))
    if len(layers) > max_layers:
        layers = sorted(sorted(layers, key=load.layer_imbalance, reverse=True)[:max_layers])
    bar_width = max(8, width - LABEL_WIDTH)
    for layer in layers:
        imbalance = load.layer_imbalance(layer)
        line = Text(f"L{layer:<3} x{imbalance:<5.2f}  ", style="red" if imbalance >= HOT_IMBALANCE else "dim")
        for count in _binned(load.totals[layer], bar_width):
            line.append(BARS[min(len(BARS) - 1, int(count / top * (len(BARS) - 1) + 0.5))])
        lines.append(line)
    if len(layers) < load.num_layers:
        lines.append(Text(f"({load.num_layers - len(layers)} more balanced layers not shown)", style="dim"))
    return lines


class ExpertPanel(Static):
    """The expert-load lines under the step charts; display off while the view has no counts."""

    def update_view(self, view: EngineView) -> None:
        load = view.experts
        self.display = load.num_layers > 0
        if not self.display:
            return
        self.update(Text("\n").join(expert_lines(load, self.size.width or 100, MAX_LAYERS)))
