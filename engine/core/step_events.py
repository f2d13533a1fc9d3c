"""Build the ``step`` event from a finished step.

The one place that turns a :class:`~engine.core.scheduler.SchedulerOutput` (completed
by ``update_from_output``) and the step's timings into a
:class:`~engine.events.StepEvent`; the deterministic driver, the real engine and
the simulator all call it, so every producer writes the same record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.core.block_pool import BlockDeltas, flatten_groups, group_counts
from engine.core.scheduler import SchedulerOutput
from engine.events import EventBus, StepEvent
from engine.events.step_records import EncoderStepEvent

TIMING_KEYS = ("schedule_s", "forward_s", "sample_s", "update_s", "duration_s")


def cached_runs(deltas: BlockDeltas) -> list[dict[str, Any]]:
    """The step event's ``cached_runs``: what the newly cached blocks hold, in ``cached``
    order; empty unless the pool records contents."""
    if deltas.stored is None:
        return []
    if deltas.grouped:  # several groups (or a window): each run's group
        return [{"block_ids": run.block_ids, "hashes": run.hashes, "parent_hash": run.parent_hash,
                 "token_ids": run.token_ids, "group_idx": run.group}
                for stored in deltas.stored for run in stored.pieces()]
    return [{"block_ids": run.block_ids, "hashes": run.hashes, "parent_hash": run.parent_hash,
             "token_ids": run.token_ids} for stored in deltas.stored for run in stored.pieces()]


def group_fields(deltas: BlockDeltas) -> dict[str, Any]:
    """The step's per-group fields: written when the pool has several groups or a window
    (one full-attention group's events carry the flat lists alone)."""
    if not deltas.grouped:
        return {}
    return {
        "allocated_groups": group_counts(deltas.allocated_by_group),
        "freed_groups": group_counts(deltas.freed_by_group),
        "cached_groups": list(deltas.cached.values()),
        "evicted_groups": list(deltas.evicted_groups),
        "freed_by_window": flatten_groups(deltas.window_freed_by_group),
        "freed_by_window_groups": group_counts(deltas.window_freed_by_group),
    }


def build_step_event(output: SchedulerOutput, timings: Mapping[str, Any] | None = None) -> StepEvent:
    """The step event for ``output``; call after ``update_from_output`` returned.

    ``timings`` may hold any of ``schedule_s``, ``forward_s``, ``sample_s``,
    ``update_s``, ``duration_s`` (seconds; missing ones are 0), and under pipeline
    parallelism ``pipeline_bubble_s`` / ``pipeline_bytes`` (one entry per stage).
    """
    t = timings or {}
    deltas = output.deltas
    return StepEvent(
        index=output.step_index,
        scheduled={s.request.request_id: [s.num_tokens, "prefill" if s.is_prefill else "decode"] for s in output.scheduled},
        num_prefill_tokens=output.num_prefill_tokens,
        num_decode_tokens=output.num_decode_tokens,
        num_running=output.num_running,
        num_waiting=output.num_waiting,
        kv_blocks_used=output.num_blocks_used,
        kv_blocks_cached_free=output.num_blocks_cached_free,
        kv_blocks_total=output.num_blocks_total,
        kv_blocks_used_forward=output.num_blocks_used_scheduled,
        kv_tokens_read=output.kv_tokens_read,
        allocated=deltas.all_allocated(),
        freed=deltas.all_freed(),
        cached=list(deltas.cached),
        evicted=deltas.evicted,
        cached_runs=cached_runs(deltas),
        evicted_hashes=deltas.evicted_hashes or [],
        new=output.new_req_ids,
        resumed=output.resumed_req_ids,
        preempted=output.preempted_req_ids,
        finished=output.finished,
        prefix_queries_tokens=deltas.prefix_query_tokens,
        prefix_hits_tokens=deltas.prefix_hit_tokens,
        duration_s=t.get("duration_s", 0.0),
        schedule_s=t.get("schedule_s", 0.0),
        forward_s=t.get("forward_s", 0.0),
        sample_s=t.get("sample_s", 0.0),
        update_s=t.get("update_s", 0.0),
        collective_s=t.get("collective_s", 0.0),
        collective_bytes=int(t.get("collective_bytes", 0)),
        collective_calls=int(t.get("collective_calls", 0)),
        expert_counts=[[int(n) for n in row] for row in t.get("expert_counts") or ()],
        prompt_logprob_rows=int(t.get("prompt_logprob_rows", 0)),
        pipeline_bubble_s=[float(v) for v in t.get("pipeline_bubble_s") or ()],
        pipeline_bytes=[int(v) for v in t.get("pipeline_bytes") or ()],
        waiting_reasons=output.waiting_reasons,
        waiting_reasons_omitted=output.waiting_reasons_omitted,
        prefix_lookups=output.prefix_lookups,
        **group_fields(deltas),
    )


def build_encoder_event(output: SchedulerOutput, timings: Mapping[str, float] | None = None) -> EncoderStepEvent:
    """The ``encoder.step`` event of a step of a model with an encoder (``encode_s``
    from the timings; 0 when the executor did not time it)."""
    return EncoderStepEvent(
        index=output.step_index,
        encoded=[[rid, index, tokens] for rid, index, tokens in output.encoder_inputs],
        freed=[[rid, index] for rid, index in output.encoder_freed],
        encoder_tokens=sum(tokens for _, _, tokens in output.encoder_inputs),
        cache_used_tokens=output.encoder_cache_used,
        cache_capacity_tokens=output.encoder_cache_capacity,
        encode_s=(timings or {}).get("encode_s", 0.0),
    )


def publish_step_event(
    bus: EventBus | None, output: SchedulerOutput, timings: Mapping[str, float] | None = None
) -> StepEvent | None:
    """Build and publish the step event, or do nothing when nobody listens. A model
    with an encoder publishes the step's ``encoder.step`` event first."""
    if bus is None or not bus.has_subscribers:
        return None
    if output.encoder_cache_capacity:
        bus.publish(build_encoder_event(output, timings))
    event = build_step_event(output, timings)
    bus.publish(event)  # stamps seq and t on the event itself
    return event
