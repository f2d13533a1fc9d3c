"""A kvscope recording as a capacity trace: each ``request.arrived`` (its time less
``preprocess_s``, when the server received it, as TTFT counts) with its prompt tokens, and the
output tokens its ``request.finished`` says it produced (its ``max_tokens`` when it never
finished). A request whose first admission hit the prefix cache keeps that many tokens as its
shared prefix, so the simulated prompts share as the recorded ones did (one shared run for every
such request: the simulator's prompts have one shared prefix). The recording itself stays on the
trace: its step events fit this machine's per-step cost (engine/sim/step_fit.py)."""

from __future__ import annotations

from pathlib import Path

from engine.events import RequestArrived, RequestFinished, RequestScheduled
from engine.sim.replay import load_recording
from engine.sim.traces import Trace, finish_trace, request
from engine.sim.workload import WorkloadRequest


def read_recording_trace(path: str | Path) -> Trace:
    rec = load_recording(path)
    arrived: dict[str, RequestArrived] = {}
    outputs: dict[str, int] = {}
    hits: dict[str, int] = {}
    for ev in rec.events:
        if isinstance(ev, RequestArrived):
            arrived.setdefault(ev.request_id, ev)
        elif isinstance(ev, RequestFinished) and ev.output_tokens > 0:
            outputs[ev.request_id] = ev.output_tokens
        elif isinstance(ev, RequestScheduled):
            hits.setdefault(ev.request_id, ev.prefix_hit_tokens)
    rows: list[WorkloadRequest] = []
    unfinished = 0
    for rid, ev in arrived.items():
        unfinished += rid not in outputs
        row = request(ev.prompt_tokens, outputs.get(rid, ev.max_tokens), ev.t - ev.preprocess_s, hits.get(rid, 0))
        if row is not None:
            rows.append(row)
    notes = []
    if unfinished:
        notes.append(f"{unfinished} requests never finished in the recording: their max_tokens stand for their output")
    model = (rec.config.get("served_model_name") or rec.config.get("model")) or None
    for ev in rec.events:
        if ev.type == "engine.config":
            model = str(getattr(ev, "model", {}).get("name") or model)
            break
    return finish_trace(rows, "recording", path, notes=notes, model=model, recording=rec)
