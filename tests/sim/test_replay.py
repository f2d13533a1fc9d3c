"""engine replay: --verify on recordings of simulations, of scripted scheduler
runs with stop finishes and aborts, and of the real engine (bundled model, with
preemptions and prefix hits); edited recordings fail at exactly the edited step;
a recording cut at any byte replays up to its last whole step; --at prints the
state."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.cli import main
from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.step_events import publish_step_event
from engine.errors import UserError
from engine.events import EventBus, JsonlSink, RequestScheduled, StartupPhase, StepEvent, read_events
from engine.sim.replay import Replayer, load_recording
from engine.sim.simulate import Simulation, build_setup
from engine.sim.workload import WorkloadSpec, generate_workload
from tests.paths import SAMPLES


@pytest.fixture(scope="module")
def sim_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulation with preemptions and prefix-cache hits."""
    setup = build_setup(engine=EngineConfig(max_model_len=8192), num_gpu_blocks_override=1500)
    path = tmp_path_factory.mktemp("replay") / "sim.jsonl"
    bus = EventBus()
    sink = JsonlSink(path, config=setup.recording_config())
    bus.subscribe(sink)
    spec = WorkloadSpec(60, (200, 3000), (50, 300), arrival="poisson", rate=30.0, unit="s",
                        shared_prefix_fraction=0.5, shared_prefix_tokens=700, seed=5)
    result = Simulation(setup, bus, stats_interval=1.0).run(generate_workload(spec))
    sink.close()
    assert result.preemptions > 0 and result.finished == 60
    return path


def _steps(path: Path) -> list[StepEvent]:
    return [e for e in read_events(path).events if isinstance(e, StepEvent)]


def test_verify_passes_on_a_simulation_with_preemptions_and_prefix_hits(sim_recording: Path) -> None:
    rec = load_recording(sim_recording)
    assert any(isinstance(e, RequestScheduled) and e.prefix_hit_tokens > 0 for e in rec.events)
    replayer = Replayer(rec)
    report = replayer.run()
    assert report.ok, replayer.render_divergence(report.divergence)  # type: ignore[arg-type]
    assert report.steps_replayed == len(_steps(sim_recording)) and not report.line_cut


def _rewrite(src: Path, dst: Path, edit) -> None:  # type: ignore[no-untyped-def]
    lines = src.read_text().splitlines()
    out = [edit(line) for line in lines]
    dst.write_text("\n".join(line for line in out if line is not None) + "\n")


def test_a_changed_block_id_fails_at_exactly_that_step(sim_recording: Path, tmp_path: Path) -> None:
    steps = _steps(sim_recording)
    target = next(s for s in steps[len(steps) // 2 :] if s.allocated)
    rid, blocks = next(iter(target.allocated.items()))

    def edit(line: str) -> str:
        row = json.loads(line)
        if row.get("type") == "step" and row["index"] == target.index:
            row["allocated"][rid][0] = (blocks[0] + 1) % target.kv_blocks_total
            return json.dumps(row)
        return line

    edited = tmp_path / "edited.jsonl"
    _rewrite(sim_recording, edited, edit)
    replayer = Replayer(load_recording(edited))
    report = replayer.run()
    div = report.divergence
    assert div is not None and div.replayed.index == target.index and div.position == target.index
    assert div.fields == ["allocated"] and div.request_ids == [rid]
    text = replayer.render_divergence(div)
    assert f"MISMATCH at step {target.index}" in text and rid in text


def test_a_removed_step_fails_at_exactly_that_step(sim_recording: Path, tmp_path: Path) -> None:
    steps = _steps(sim_recording)
    gone = steps[len(steps) // 3].index

    def edit(line: str) -> str | None:
        row = json.loads(line)
        return None if row.get("type") == "step" and row["index"] == gone else line

    edited = tmp_path / "removed.jsonl"
    _rewrite(sim_recording, edited, edit)
    replayer = Replayer(load_recording(edited))
    div = replayer.run().divergence
    assert div is not None and div.replayed.index == gone and div.recorded.index == gone + 1
    assert "index" in div.fields
    assert "a step is missing from the recording" in replayer.render_divergence(div)


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_a_recording_cut_at_any_byte_replays_its_whole_steps(sim_recording: Path, tmp_path: Path) -> None:
    data = sim_recording.read_bytes()
    lines_end = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    rng = random.Random(0)
    cuts = sorted({0, 1, lines_end[0] - 1, lines_end[0], lines_end[12] + 7, len(data) - 1, len(data)}
                  | {rng.randrange(len(data)) for _ in range(25)})
    cut_file = tmp_path / "cut.jsonl"
    for cut in cuts:
        cut_file.write_bytes(data[:cut])
        parsed = [_parses(line) for line in data[:cut].split(b"\n") if line]
        expected_steps = sum(1 for row in parsed if row is not None and row.get("type") == "step")
        try:
            replayer = Replayer(load_recording(cut_file))
        except UserError as exc:  # header cut, or no pool size yet
            assert expected_steps == 0, f"cut at {cut}: {exc}"
            continue
        report = replayer.run()
        assert report.ok, f"cut at {cut}: false mismatch"
        assert report.steps_replayed == expected_steps, f"cut at {cut}"
        assert report.line_cut == (parsed[-1] is None), f"cut at {cut}"


def _parses(line: bytes) -> dict | None:  # type: ignore[type-arg]
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _scripted_recording(path: Path) -> tuple[int, int]:
    """A scheduler run with random stop finishes and aborts between steps, recorded
    as the engine does (header = EngineConfig dict, phase E = pool). Returns
    (stops, aborts)."""
    engine_cfg = EngineConfig(max_num_seqs=6, max_num_batched_tokens=256, max_model_len=480, block_size=16)
    cfg = SchedulerConfig(num_blocks=30, block_size=16, max_num_seqs=6, max_num_batched_tokens=256, max_model_len=480)
    rng = random.Random(7)
    bus = EventBus(clock=lambda: 0.0)
    sink = JsonlSink(path, config=engine_cfg.to_dict())
    bus.subscribe(sink)
    bus.publish(StartupPhase(phase="E", name="kv_cache", status="end", data={"num_blocks": 30, "block_size": 16,
                                                                              "max_model_len": 480}))
    sched = Scheduler(cfg, bus)
    stops = aborts = 0
    system = [rng.randrange(1000) for _ in range(48)]
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randrange(5, 120))]
            sched.add_request(Request(f"q{step}", prompt, rng.randrange(5, 80), stop_token_ids=(999_999,)), float(step))
        if sched.running and rng.random() < 0.03:
            sched.abort(rng.choice(sched.running).request_id, float(step))
            aborts += 1
        if not sched.has_unfinished():
            continue
        out = sched.schedule(float(step))
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                stop = rng.random() < 0.02
                stops += stop
                sampled[s.request.request_id] = [999_999 if stop else rng.randrange(1000)]
        sched.update_from_output(out, sampled, float(step))
        publish_step_event(bus, out)
    sink.close()
    return stops, aborts


def test_verify_replays_stop_finishes_and_aborts(tmp_path: Path) -> None:
    path = tmp_path / "scripted.jsonl"
    stops, aborts = _scripted_recording(path)
    assert stops > 0 and aborts > 0
    rec = load_recording(path)
    assert sum(1 for e in rec.events if isinstance(e, StepEvent) and e.preempted) > 0
    replayer = Replayer(rec)
    report = replayer.run()
    assert report.ok, replayer.render_divergence(report.divergence)  # type: ignore[arg-type]


@pytest.mark.slow  # 3-6 s each on a 2-core machine: in make test-slow, to keep the default suite under 5 min
def test_verify_on_a_real_engine_recording(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled model on a 45-block pool (32 MiB of float32 KV: the same on every ISA): preemptions
    and prefix hits."""
    path = tmp_path / "real.jsonl"
    code = main(["run-workload", "--num-prompts", "8", "--random-input-len", "60:120", "--random-output-len", "30:70",
                 "--max-model-len", "512", "--kv-cache-memory-bytes", "32Mi", "--dtype", "float32",
                 "--shared-prefix-fraction", "0.5",
                 "--shared-prefix-len", "48", "--threads", "1", "--events", str(path), "--log-format", "json"])
    assert code == 0
    capsys.readouterr()
    steps = _steps(path)
    assert any(s.preempted for s in steps), "the pool must be small enough to preempt"
    assert sum(s.prefix_hits_tokens for s in steps) > 0
    assert main(["replay", str(path), "--verify"]) == 0
    assert "OK:" in capsys.readouterr().out


def test_cli_verify_at_and_mismatch_exit_codes(sim_recording: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(sim_recording), "--verify"]) == 0
    assert "every decision matches" in capsys.readouterr().out
    assert main(["replay", str(sim_recording), "--at", "40"]) == 0
    out = capsys.readouterr().out
    for section in ("state after step 40", "running (", "waiting (", "block owners", "memory ledger",
                    "KV cache pool", "KV blocks used"):
        assert section in out, section
    assert main(["replay", str(sim_recording), "--at", "999999"]) == 2
    assert "--at 999999" in capsys.readouterr().err
    cut = tmp_path / "cut.jsonl"
    data = sim_recording.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    assert main(["replay", str(cut)]) == 0
    assert "replayed up to its last whole step" in capsys.readouterr().out
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2


def test_the_committed_simulation_sample_verifies() -> None:
    """samples/sim_h100_llama8b.jsonl (monitor fixture) was made with:
    engine simulate --num-prompts 150 --random-input-len 200:2500 --random-output-len 40:300 --arrival poisson
    --request-rate 12 --arrival-unit s --shared-prefix-fraction 0.4 --shared-prefix-len 512 --max-num-seqs 64
    --num-gpu-blocks-override 2500 --max-model-len 8192 --workload-seed 11 --events samples/sim_h100_llama8b.jsonl"""
    path = SAMPLES / "sim_h100_llama8b.jsonl"
    assert path.stat().st_size < 3 * 2**20
    replayer = Replayer(load_recording(path))
    report = replayer.run()
    assert report.ok and report.steps_replayed == 1067
    steps = [s.event for s in replayer.steps]
    assert sum(len(s.preempted) for s in steps) == 8 and sum(s.prefix_hits_tokens for s in steps) > 0


def test_the_monitor_sample_is_reproduced_by_its_command_and_verifies(tmp_path: Path) -> None:
    """samples/monitor_sim.jsonl is exactly what tests/monitor_fixtures.py's command records
    (byte for byte once the output path is the committed one), and it replays."""
    from tests.monitor_fixtures import SAMPLE, SAMPLE_COMMAND

    out = tmp_path / "monitor_sim.jsonl"
    assert main([*SAMPLE_COMMAND, "--events", str(out)]) == 0
    # the header and the engine.config event record the --events path the command was given
    recorded = out.read_text().replace(str(out), "samples/monitor_sim.jsonl").splitlines()
    assert recorded == SAMPLE.read_text().splitlines()
    report = Replayer(load_recording(SAMPLE)).run()
    assert report.ok and report.steps_replayed == 442
