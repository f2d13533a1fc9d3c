"""dashboards/grafana/kvscope.json (issue 18 part 5): every PromQL expression in it
parses with a real PromQL parser (promql-parser, the Rust parser Prometheus' own
grammar was ported to) and names only series kvscope's /metrics serves, taken from
the registry after a model-free run (tests/preempting_run.py), not from a list; the
datasource is the ${DS_PROMETHEUS} input and every query filters on vLLM's
model_name / engine labels, so the same board reads a vLLM server."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.paths import ROOT
from tests.preempting_run import preempting_run

DASHBOARD = ROOT / "dashboards" / "grafana" / "kvscope.json"
# Grafana's own variables, as it substitutes them before Prometheus parses the query
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model_name": ".*", "$engine": ".*"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def selector_names(expr: str) -> set[str]:
    """Metric names of every vector selector in ``expr`` (raises ValueError if it does not parse)."""
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def queries(dashboard) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable's selector."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in walk_panels(dashboard["panels"]) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        match = LABEL_VALUES.match(variable["query"]["query"])
        assert match, f"variable {variable['name']}: expected label_values(selector, label)"
        out.append((f"variable {variable['name']}", match["selector"]))
    return out


def test_every_expression_parses_and_names_only_served_series(queries) -> None:
    text = preempting_run().metrics.render().decode()
    served = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert len(queries) > 40
    unserved: dict[str, set[str]] = {}
    for where, expr in queries:
        try:
            names = selector_names(expr)
        except ValueError as exc:
            raise AssertionError(f"{where}: {expr!r} does not parse: {exc}") from None
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - served
        if missing:
            unserved[where] = missing
    assert not unserved, f"series /metrics does not serve: {unserved}"
    # the board covers what issue 18 asks of it
    everything = set().union(*(selector_names(e) for _w, e in queries))
    for needed in ("vllm:num_preemptions_by_reason_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:prefix_cache_hits_total", "vllm:kv_block_lifetime_seconds_bucket",
                   "vllm:estimated_flops_per_gpu_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                   # the accounting panels: counters against per-request sums, aborts by cause
                   "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
                   "kvscope:request_abort_total", "kvscope:prompt_tokens_discarded_total"):
        assert needed in everything, needed


def test_datasource_is_an_input_and_queries_filter_on_vllm_labels(dashboard, queries) -> None:
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    for panel in walk_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert 'engine=~"$engine"' in target["expr"], (panel["title"], target["expr"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"model_name", "engine"}


def test_a_broken_expression_is_caught() -> None:
    with pytest.raises(ValueError):
        selector_names('sum(rate(vllm:prompt_tokens_total{model_name=~"$model_name"}[$__rate_interval])')
