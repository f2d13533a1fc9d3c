"""``engine replay``: re-run the scheduler from a recording.

  engine replay run.jsonl --verify     compare every step's decisions with the
                                       recording; exit 1 at the first mismatch,
                                       printed side by side
  engine replay run.jsonl --at STEP    the state after STEP: queues, block owners,
                                       memory ledger
  engine replay run.jsonl --trace-out trace.json
                                       a Perfetto / Chrome timeline of the recording
                                       (--trace is the same flag here)
  engine replay run.jsonl --otlp URL   its startup and request spans, sent to an
                                       OTLP endpoint with their original times
  engine replay run.jsonl --request ID one request's life step by step: arrival, each
                                       step it waited and why, prefill chunks, where its
                                       prefix-cache match stopped, preemptions, decode,
                                       blocks held, finish (--json: the same as data)
  engine replay run.jsonl --session K  a session's turns: for each, how many of the
                                       previous turn's blocks were still resident, and
                                       each lost block with the request whose allocation
                                       evicted it and the step (--json: the same as data)

Works on recordings of the real engine (--events) and of engine simulate; a
recording cut at any byte is replayed up to its last whole step.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from engine.cli.exporters import add_exporter_flags, build_exporters, exporters_asked, recording_wall_start
from engine.cli.program import Subparsers
from engine.errors import UserError
from engine.events import Recording
from engine.sim.replay import Replayer, ReplayReport, load_recording


def register(sub: Subparsers) -> None:
    p = sub.add_parser("replay", help="re-run the scheduler from a recording; verify decisions or inspect a step",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", help="JSONL event file")
    p.add_argument("--verify", action="store_true", help="compare every step with the recording (default)")
    p.add_argument("--at", type=int, default=None, metavar="STEP", help="print the state after this step")
    p.add_argument("--request", default=None, metavar="ID",
                   help="print one request's life, step by step, folded from the recording's events")
    p.add_argument("--session", default=None, metavar="KEY",
                   help="print one session's turns (its X-Session-Id, cache_salt or user): the previous turn's "
                        "blocks still resident at each turn, and who evicted the rest")
    p.add_argument("--json", action="store_true", help="with --request or --session: the same as one JSON object")
    add_exporter_flags(p, replay=True)
    p.set_defaults(func=run)


def export(args: argparse.Namespace, recording: Recording) -> None:
    """Hand the recording's events to the exporters the flags ask for, as a live run would."""
    last_t = recording.events[-1].t if recording.events else 0.0
    wall_start, note = recording_wall_start(recording.header, args.recording, last_t)
    exporters = build_exporters(args, wall_start, model_name=recording.config.get("served_model_name")
                                or recording.config.get("model"))
    if note and args.otlp_traces_endpoint:
        print(note)
    exporters.feed(recording.events)
    exporters.close()
    for line in exporters.summary:
        print(line)


def _cut_note(report: ReplayReport, replayer: Replayer) -> str | None:
    if not report.line_cut and not report.tail_events:
        return None
    last = replayer.steps[-1].event.index if replayer.steps else None
    where = f"after step {last}" if last is not None else "before the first step"
    what = "its last line is cut" if report.line_cut else "it ends mid-step"
    extra = f"; {report.tail_events} later events belong to a step that was not recorded whole" if report.tail_events else ""
    return f"note: the recording is incomplete ({what}): replayed up to its last whole step, {where}{extra}"


def _first_names(names: Iterable[str], shown: int = 8) -> tuple[int, str]:
    """How many ``names`` there are and the first ``shown`` of them, for a "no such" message."""
    known = list(names)
    return len(known), ", ".join(known[:shown]) + (" …" if len(known) > shown else "")


def show_request(recording: Recording, request_id: str, as_json: bool) -> int:
    """``--request ID``: the request's life from the events alone (no scheduler re-run)."""
    from engine.events import dumps
    from engine.events.folds.request_record import lifecycle_of

    fold = lifecycle_of(recording.events)
    life = fold.get(request_id)
    if life is None:
        count, sample = _first_names(fold.lives)
        raise UserError(f"--request {request_id}: no such request in {recording.header.get('config', {}).get('events_path') or 'the recording'}"
                        f" ({count} requests: {sample or 'none'})")
    print(dumps(life.to_dict()) if as_json else life.render())
    return 0


def show_session(recording: Recording, key: str, as_json: bool) -> int:
    """``--session KEY``: the session's turns from the events alone (no scheduler re-run)."""
    from engine.events import dumps
    from engine.events.folds.sessions import SessionFold

    fold = SessionFold()
    for event in recording.events:
        if not getattr(event, "dp_rank", 0):  # block ids are per engine core: rank 0's pool
            fold(event)
    session = fold.get(key)
    if session is None:
        count, sample = _first_names(fold.sessions)
        raise UserError(f"--session {key}: no request of the recording names this session ({count} sessions: "
                        f"{sample or 'none; a session is an X-Session-Id header, a cache_salt or a user'})")
    print(dumps(session.to_dict()) if as_json else session.render())
    return 0


def run(args: argparse.Namespace) -> int:
    recording = load_recording(args.recording)
    if args.json and args.request is None and args.session is None:
        raise UserError("--json goes with --request ID or --session KEY (the same as data)")
    if args.request is not None:
        return show_request(recording, args.request, args.json)
    if args.session is not None:
        return show_session(recording, args.session, args.json)
    if exporters_asked(args):
        export(args, recording)
        if not args.verify and args.at is None:
            return 0
    replayer = Replayer(recording)
    if not replayer.steps:
        note = "the recording has no whole step event: nothing to replay"
        if args.at is not None:
            raise UserError(f"--at {args.at}: {note}")
        print(note)
        return 0
    if args.at is not None:
        indices = [s.event.index for s in replayer.steps]
        if args.at not in indices:
            raise UserError(f"--at {args.at}: the recording has steps {indices[0]}..{indices[-1]}")
        report = replayer.run(until_step=args.at, verify=True)
    else:
        report = replayer.run(verify=True)
    note = _cut_note(report, replayer)
    if note:
        print(note)
    if report.divergence is not None:
        print(replayer.render_divergence(report.divergence))
        if args.at is not None:
            print(f"(replay stopped at the mismatch; showing the replayed state there, not step {args.at})")
            print(replayer.render_state())
        return 1
    if args.at is not None:
        print(f"verified steps 0..{args.at}: every decision matches the recording")
        print(replayer.render_state())
        return 0
    cfg = replayer.config
    decode_step = f", max-decode-step-tokens {cfg.max_decode_step_tokens}" if cfg.max_decode_step_tokens else ""
    print(f"OK: {report.steps_replayed:,} steps replayed; every decision matches the recording "
          f"(scheduler: {cfg.num_blocks:,} blocks of {cfg.block_size}, "
          f"max-num-seqs {cfg.max_num_seqs}, max-num-batched-tokens {cfg.max_num_batched_tokens}{decode_step})")
    return 0
