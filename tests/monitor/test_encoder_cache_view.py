"""The encoder cache beside the KV pool: EngineView folds encoder.step events and the
dashboard's memory panel shows it, for vision-language runs only."""

from __future__ import annotations

from rich.console import Console

from engine.config import EngineConfig
from engine.events import EventBus
from engine.events.folds.view import EngineView
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadRequest, with_mm_items
from monitor.widgets.memory_bar import MemoryBar


def rendered(view: EngineView) -> str:
    bar = MemoryBar()
    bar._view = view
    console = Console(width=200, record=True)
    console.print(bar._render_bar())
    return console.export_text()


def test_encoder_cache_beside_the_kv_pool() -> None:
    setup = build_setup("qwen2.5-vl-7b", "h100-80gb", EngineConfig(max_model_len=8192, max_num_batched_tokens=512),
                        multimodal={"limit_mm_per_prompt": "image=1", "image_size": (1280, 720)})
    assert setup.plan.multimodal is not None
    bus = EventBus()
    view = EngineView()
    bus.subscribe(view.apply)
    seen: list[tuple[int, int]] = []
    bus.subscribe(lambda e: seen.append((view.encoder_cache_used, view.encoder_cache_capacity)) if e.type == "step"
                  else None)
    workload = with_mm_items([WorkloadRequest("r0", 100, 4)], setup.plan.multimodal.prompt_items())
    Simulation(setup, bus).run(workload)
    # one 1,196-token image parked through two 512-token chunks, freed by the third
    assert seen[:3] == [(1196, 1196), (1196, 1196), (0, 1196)]
    assert "encoder cache 0/1,196 tokens" in rendered(view)
    assert not [e for e in view.recent if e.type == "encoder.step"]
    again = EngineView.from_snapshot(view.snapshot())
    assert (again.encoder_cache_used, again.encoder_cache_capacity) == (0, 1196)
    text = EngineView.from_snapshot(EngineView().snapshot())
    assert "encoder_cache" not in EngineView().snapshot() and "encoder cache" not in rendered(text)
