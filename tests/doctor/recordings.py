"""The doctor's test recordings: each made by ``engine simulate`` (model-free, its
clock simulated, so byte for byte reproducible) and stored gzipped under
tests/data/doctor/ (gzip without a timestamp). Re-make them all from the
repository root with ``python -m tests.doctor.recordings``.

``startup_refused.jsonl.gz`` is a real start refused in phase B (wall-clock times,
so not byte-reproducible), made with::

    engine generate --prompt hi --max-model-len 8192 --kv-cache-memory-bytes 1MiB \\
        --events tests/data/doctor/startup_refused.jsonl && gzip -n tests/data/doctor/startup_refused.jsonl
"""

from __future__ import annotations

import contextlib
import gzip
import io
from pathlib import Path

from engine.cli.main import main
from tests.paths import ROOT

DATA = ROOT / "tests" / "data" / "doctor"
LONG_PROMPTS_TRACE = "tests/data/doctor/long_prompts_trace.jsonl"  # 24 streams, then 16,000- and 12,000-token prompts

# name -> the `engine simulate` arguments (before --events), as a person types them.
COMMANDS: dict[str, str] = {
    # light traffic, nothing binds: the doctor must stay silent
    "healthy": "--num-prompts 20 --random-input-len 200:600 --random-output-len 30:80 --arrival poisson "
               "--request-rate 4 --arrival-unit s",
    # a small L4 pool, 32 requests at once that grow past it
    "pool_binds": "--gpu l4 --gpu-memory-utilization 0.8 --max-model-len 4096 --num-prompts 32 "
                  "--random-input-len 100:300 --random-output-len 300:500",
    # short requests behind 8 sequence slots, the pool nearly empty
    "max_num_seqs_binds": "--max-num-seqs 8 --num-prompts 48 --random-input-len 100:300 --random-output-len 50:150",
    # two long documents arrive while 24 requests stream
    "long_prompts": f"--trace {LONG_PROMPTS_TRACE}",
    # many medium prompts at 60/s: most steps carry prefill
    "decode_starved": "--num-prompts 100 --random-input-len 300:900 --random-output-len 40:80 --arrival poisson "
                      "--request-rate 60 --arrival-unit s",
    # 40 prompts/s through a 512-token step budget
    "ttft_token_budget": "--max-num-batched-tokens 512 --num-prompts 60 --random-input-len 1000:2000 "
                         "--random-output-len 20:60 --arrival poisson --request-rate 40 --arrival-unit s",
    # the same arrivals under kvscope's CPU-style budgets: prompts alone may take 4,096 tokens a step,
    # a step with decodes 512 (--max-decode-step-tokens), and that is what binds
    "ttft_decode_step": "--max-num-batched-tokens 4096 --max-decode-step-tokens 512 --num-prompts 60 "
                        "--random-input-len 1000:2000 --random-output-len 20:60 --arrival poisson --request-rate 40 "
                        "--arrival-unit s",
    # a 512-token shared prefix on a 160-block pool: its cached blocks are evicted
    "prefix_evicted": "--num-gpu-blocks-override 160 --max-num-seqs 32 --max-model-len 2048 --num-prompts 60 "
                      "--random-input-len 600:900 --random-output-len 50:100 --shared-prefix-fraction 0.7 "
                      "--shared-prefix-len 512 --arrival poisson --request-rate 0.5 --arrival-unit step",
}


def path_of(name: str) -> Path:
    return DATA / f"{name}.jsonl.gz"


def simulate_recording(name: str) -> bytes:
    """Run ``name``'s command into its recording path (relative, as the header records
    it) and return the gzipped bytes; the plain file is removed."""
    plain = f"tests/data/doctor/{name}.jsonl"
    argv = ["simulate", *COMMANDS[name].split(), "--stats-interval", "5", "--events", plain]
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
        data = Path(plain).read_bytes()
        Path(plain).unlink()
    return gzip.compress(data, compresslevel=9, mtime=0)


if __name__ == "__main__":
    for recording in COMMANDS:
        path_of(recording).write_bytes(simulate_recording(recording))
        print(f"wrote {path_of(recording).relative_to(ROOT)}")
