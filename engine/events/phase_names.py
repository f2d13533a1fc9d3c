"""kvscope's startup phases A–G under the span names vLLM's own startup tracing uses.

vLLM traces its cold start with OpenTelemetry spans (``@instrument(span_name=...)``
in its source). kvscope's phases are cut differently, so this table says, for each
letter, which span name a trace of kvscope uses and which vLLM function carries that
name, so a kvscope trace and a vLLM trace line up in Tempo or Jaeger, and a timeline
logparse derives from a vLLM log uses the same words.

vLLM's spans (its source, 2026):

- ``API server setup``: ``setup_server`` (argument checks, the listening socket);
  kvscope binds its port before phase A, which is no phase of its own.
- ``Init device``: ``Worker.init_device`` (device, distributed environment).
- ``Load model``: ``BaseModelLoader.load_model`` (with ``Initialize model`` inside).
- ``Prepare model``: ``EngineCore._initialize_kv_caches``: the profile run that
  measures free memory, the KV cache config and allocation, and then, inside it,
  ``Compile/warmup`` (``Worker.compile_or_warm_up_model``).

Phases B (the memory budget, checked before weights load), D (the profile run), E
(the KV pool) and G (ready) have no span of their own in vLLM; kvscope names them
plainly, and :data:`VLLM_GROUPS` says which vLLM span covers D–F together, so an
exporter can emit that parent and keep vLLM's tree (``Prepare model`` ⊃
``Compile/warmup``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events.startup_records import PHASES


@dataclass(frozen=True, slots=True)
class PhaseSpanName:
    """One phase letter's span: its name, and the vLLM function that uses the same
    name (``None`` where vLLM has no span for it)."""

    letter: str
    span_name: str
    vllm_function: str | None


PHASE_SPANS: dict[str, PhaseSpanName] = {
    span.letter: span for span in (
        PhaseSpanName("A", "Init device", "Worker.init_device"),
        PhaseSpanName("B", "Memory budget", None),
        PhaseSpanName("C", "Load model", "BaseModelLoader.load_model"),
        PhaseSpanName("D", "Profile run", None),
        PhaseSpanName("E", "KV cache allocation", None),
        PhaseSpanName("F", "Compile/warmup", "Worker.compile_or_warm_up_model"),
        PhaseSpanName("G", "Ready", None),
    )
}

#: vLLM spans that cover several kvscope phases: span name -> the letters inside it,
#: in order (``Prepare model`` is ``EngineCore._initialize_kv_caches``).
VLLM_GROUPS: dict[str, tuple[str, ...]] = {"Prepare model": ("D", "E", "F")}

#: vLLM's span around argument checks and the server socket (``setup_server``).
API_SERVER_SETUP = "API server setup"

def span_name(letter: str) -> str:
    """The span name for phase ``letter`` (A–G); a clear error for any other letter."""
    try:
        return PHASE_SPANS[letter].span_name
    except KeyError:
        raise ValueError(f"unknown startup phase {letter!r}: expected one of {', '.join(PHASES)}") from None


def vllm_group(letter: str) -> str | None:
    """The vLLM span that contains phase ``letter`` (``Prepare model`` for D–F), else None."""
    return next((group for group, letters in VLLM_GROUPS.items() if letter in letters), None)
