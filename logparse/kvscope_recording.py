"""A real kvscope run (``logparse explain --profile events.jsonl``) beside the log: its startup
phase records phase by phase against vLLM's figures, and a warning when it ran another model."""

from __future__ import annotations

from typing import Any

from engine.budget.fixes import Fix
from engine.budget.memory import GiB
from engine.errors import UserError
from engine.events import Recording
from engine.events.phase_data import (
    BudgetData,
    GraphsCompileData,
    KvCacheData,
    LoadWeightsData,
    PhaseData,
    ProfileRunData,
    phase_record,
)
from engine.modelspec.presets import resolve_preset_name
from logparse.check import Check
from logparse.fold import STARTUP_PHASES
from logparse.patterns import FIGURE_NAMES

# The phase records' fields compared with vLLM's figures; which figure each one is, is
# FIGURE_NAMES' kvscope column (bytes there, GiB in the log).
_PROFILE_FIELDS: tuple[tuple[type[PhaseData], str], ...] = (
    (BudgetData, "total_bytes"),
    (BudgetData, "gpu_memory_utilization"),
    (BudgetData, "requested_bytes"),
    (LoadWeightsData, "weights_bytes"),
    (ProfileRunData, "activation_peak_bytes"),
    (ProfileRunData, "non_torch_bytes"),
    (KvCacheData, "kv_pool_bytes"),
    (KvCacheData, "num_blocks"),
    (KvCacheData, "kv_cache_tokens"),
    (KvCacheData, "max_concurrency"),
    (GraphsCompileData, "cuda_graph_bytes"),
)
_FIGURE_OF_FIELD = {name.kvscope: key for key, name in FIGURE_NAMES.items() if name.kvscope}
_VLLM_DURATIONS = {"C": ("load_model_s", "load_weights_s"), "D": ("profile_s",), "F": ("graph_capture_s", "init_engine_s")}


def read_profile(path: str) -> Recording:
    from engine.events import read_events

    try:
        return read_events(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--profile {path}: {exc}") from exc


def compare_profile(recording: Recording | str, facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Phase-by-phase rows: a kvscope recording's StartupPhase numbers beside vLLM's."""
    from engine.events import StartupPhase

    if isinstance(recording, str):
        recording = read_profile(recording)
    phases: dict[str, StartupPhase] = {}
    for event in recording.events:
        if isinstance(event, StartupPhase) and event.status in ("end", "skipped", "failed"):
            phases[event.phase] = event
    rows: list[dict[str, Any]] = []
    for letter in STARTUP_PHASES:
        last = phases.get(letter)
        if last is None:
            continue
        vllm_s = next((facts[k] for k in _VLLM_DURATIONS.get(letter, ()) if k in facts), None)
        rows.append({"phase": letter, "item": "duration_s", "kvscope": last.duration_s, "vllm": vllm_s,
                     "status": last.status})
        record = phase_record(last)
        for kind, key in _PROFILE_FIELDS:
            if isinstance(record, kind) and key in record.reported:
                value = getattr(record, key)
                if key.endswith("_bytes") and isinstance(value, int | float):
                    value = value / GiB
                figure = _FIGURE_OF_FIELD[key]
                rows.append({"phase": letter, "item": figure, "kvscope": value, "vllm": facts.get(figure)})
    return rows


def _model_keys(name: str) -> set[str]:
    """The spellings a model goes by: the preset a name resolves to (an HF id such as
    Qwen/Qwen2.5-0.5B-Instruct) and its last path part, lower-cased (a local folder named
    after the model); two names are the same model when their spellings meet."""
    last = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    preset = resolve_preset_name(name)
    return {last} if preset is None else {last, preset}


def recording_models(recording: Recording) -> dict[str, str]:
    """The models a recording names: its engine.config event's ``config.model`` and
    ``model.name`` (the header's config.model when the event is missing)."""
    from engine.events import EngineConfigEvent

    event = next((e for e in recording.events if isinstance(e, EngineConfigEvent)), None)
    config = event.config if event is not None else recording.config
    found = {"config.model": config.get("model"), "model.name": (event.model if event is not None else {}).get("name")}
    return {where: value for where, value in found.items() if isinstance(value, str) and value}


def profile_model_check(recording: Recording, facts: dict[str, Any], lines: dict[str, int]) -> Check | None:
    """A warning when the log's model is not the one the --profile recording ran."""
    ran = recording_models(recording)
    logged = facts.get("model")
    if not ran:
        return None
    if len(set(ran.values())) == 1:
        ran_text = f"{next(iter(ran.values()))!r}"
    else:
        ran_text = ", ".join(f"{where} {value!r}" for where, value in ran.items())
    if not logged:
        return Check("profile_model", "the log names no model to compare with the recording's", None,
                     f"the recording ran {ran_text}; the log does not say which model vLLM served", kind="warning")
    if any(_model_keys(str(logged)) & _model_keys(n) for n in ran.values()):
        return None
    return Check("profile_model", "the recording's model is not the log's", False,
                 f"vLLM served {str(logged)!r}, the --profile recording ran {ran_text}: "
                 "the phase-by-phase rows compare two different models",
                 kind="warning", line=lines.get("model"),
                 fix=[Fix("--profile", None, None, f"record a kvscope run of {logged} (engine serve --model "
                          f"{logged} --events events.jsonl) and pass that to --profile")])
