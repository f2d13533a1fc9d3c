"""The typed startup-phase data (engine/events/phase_data.py): every recorded
``startup.phase`` event reads back into its phase's record and writes out the same
JSON, byte for byte; a record writes exactly the fields it was given."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.budget.memory import MemoryPlan
from engine.events import PHASES, StartupPhase, dumps, read_events
from engine.events.folds.startup_state import LEDGER_KEYS
from engine.events.phase_data import (
    PHASE_DATA,
    GraphsCompileData,
    InitData,
    KvCacheData,
    LoadWeightsData,
    PhaseData,
    ProfileRunData,
    phase_record,
    read_phase,
)
from tests import paths

SAMPLES = sorted(paths.SAMPLES.glob("*.jsonl"))


def field_names(cls: type[PhaseData]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "reported")]


def test_every_phase_has_a_record() -> None:
    assert list(PHASE_DATA) == list(PHASES)
    assert all(cls.phase == letter for letter, cls in PHASE_DATA.items())


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_recorded_phase_data_round_trips_byte_for_byte(path: Path) -> None:
    phases = [e for e in read_events(path).events if isinstance(e, StartupPhase)]
    assert phases
    for event in phases:
        record = phase_record(event)
        assert isinstance(record, PHASE_DATA[event.phase])
        assert dumps(record.to_dict()) == dumps(event.data), (event.phase, event.status)


def test_the_smollm2_recording_reads_as_typed_fields() -> None:
    (path,) = [p for p in SAMPLES if p.name == "smollm2_run.jsonl"]
    ends = {e.phase: e for e in read_events(path).events if isinstance(e, StartupPhase) and e.status == "end"}
    kv = read_phase(ends["E"], KvCacheData)
    assert kv is not None and kv.num_blocks == ends["E"].data["num_blocks"] and not kv.extra
    assert read_phase(ends["E"], InitData) is None  # another phase's record
    init = read_phase(ends["A"], InitData)
    assert init is not None and init.device == ends["A"].data["device"]


def test_a_record_writes_what_it_was_given_and_nothing_else() -> None:
    record = LoadWeightsData(weights_bytes=10, quantization=None)  # None given: reported as null
    assert record.to_dict() == {"weights_bytes": 10, "quantization": None}
    assert record.load_seconds is None and "load_seconds" not in record.reported
    assert LoadWeightsData().to_dict() == {}
    # replace adds a field it sets, keeps declaration order, and keeps the nulls given
    later = dataclasses.replace(record, load_seconds=1.5)
    assert list(later.to_dict()) == ["weights_bytes", "load_seconds", "quantization"]
    assert later.to_dict()["quantization"] is None


def test_lists_are_tuples_in_a_record_and_lists_in_json() -> None:
    record = GraphsCompileData(batch_sizes=(1, 2, 4), kernels=({"name": "k", "status": "cached"},))
    assert record.to_dict() == {"batch_sizes": [1, 2, 4], "kernels": [{"name": "k", "status": "cached"}]}
    back = GraphsCompileData.from_dict(record.to_dict())
    assert back.batch_sizes == (1, 2, 4) and back == record


def test_from_dict_keeps_unknown_keys_and_tolerates_missing_ones() -> None:
    data = {"activation_peak_bytes": 5, "from_a_newer_writer": {"x": 1}, "cached": True}
    record = ProfileRunData.from_dict(data)
    assert record.activation_peak_bytes == 5 and record.cached is True and record.non_torch_bytes is None
    assert record.extra == {"from_a_newer_writer": {"x": 1}}
    assert record.to_dict() == data
    unknown_phase = phase_record(StartupPhase(phase="Z", name="later", data={"k": 1}))
    assert type(unknown_phase) is PhaseData and unknown_phase.to_dict() == {"k": 1}


def test_plan_and_simulate_report_the_same_keys_as_before() -> None:
    plan = MemoryPlan(total_bytes=80, gpu_memory_utilization=0.9, requested_bytes=72, weights_bytes=16,
                      activation_peak_bytes=4, non_torch_bytes=1, kv_pool_bytes=51, bytes_per_token=2,
                      block_size=16, num_blocks=3, kv_cache_tokens=48, max_model_len=32, max_concurrency=1.5,
                      estimated=["activation_peak"])
    data = plan.phase_data()
    assert {k: list(v) for k, v in data.items()} == {
        "B": ["total_bytes", "gpu_memory_utilization", "requested_bytes"],
        "C": ["weights_bytes"],
        "D": ["activation_peak_bytes", "non_torch_bytes", "estimated"],
        "E": ["kv_pool_bytes", "bytes_per_token", "block_size", "num_blocks", "kv_cache_tokens", "max_model_len",
              "max_concurrency", "kv_pool_overridden"],
    }
    assert data["D"]["estimated"] == ["activation_peak"] and data["E"]["kv_pool_overridden"] is False


def test_the_ledger_and_logparse_read_declared_fields() -> None:
    declared = {name for cls in PHASE_DATA.values() for name in field_names(cls)}
    assert set(LEDGER_KEYS) <= declared
    from engine.events.ledger import LEDGER
    from logparse.kvscope_recording import _PROFILE_FIELDS

    for cls, name in _PROFILE_FIELDS:
        assert name in field_names(cls), (cls.__name__, name)
    for item in LEDGER:  # the one ledger table names fields its phase's record declares
        assert item.name in field_names(PHASE_DATA[item.phase]), (item.phase, item.name)
