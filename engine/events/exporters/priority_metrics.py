"""Priority in the metrics: vLLM PR#58078's shapes (open when this was written).

Under ``--scheduling-policy priority`` every finished-request family (latencies, token
counts, ``request_success``, TTFT, inter-token latency, preemptions per request) carries a
``priority`` label, bucketed to bound cardinality: -1, 0 and 1 as themselves (high, default,
low), every lower value as ``<-1`` and every higher one as ``>1``. ``vllm:request_priority``
(a histogram of the raw priorities of finished requests) exists only then.
``vllm:scheduler_policy_info{policy}`` is always exported: 1 for the policy in force, 0 for the
other. The PR names no buckets for ``vllm:request_priority``; kvscope's are
:data:`REQUEST_PRIORITY_BUCKETS`.

A family under the label is wrapped in :class:`ByPriority`: a stand-in for the family's
child that resolves, at each use, to the child of the priority of the request the
metrics sink is handling (set from the request's ``request.arrived`` before each of its
events), so the sink's handlers observe as they would without the label.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

PRIORITY_LABEL = "priority"
SCHEDULING_POLICIES = ("fcfs", "priority")
REQUEST_PRIORITY_BUCKETS: tuple[float, ...] = (-100, -10, -5, -2, -1, 0, 1, 2, 5, 10, 100)


def priority_bucket(priority: int) -> str:
    """The ``priority`` label of a request's priority: -1, 0, 1 as themselves, else ``<-1`` / ``>1``."""
    if -1 <= priority <= 1:
        return str(priority)
    return "<-1" if priority < -1 else ">1"


class ByPriority:
    """A labelled family's child chosen by ``bucket()`` at each use (attributes delegate to it,
    so ``observe``, ``inc`` and engine/events/exporters/metrics.py's ``observe_many`` work unchanged)."""

    __slots__ = ("_bucket", "_children", "_family", "_values")

    def __init__(self, family: Any, values: tuple[str, ...], bucket: Callable[[], str]) -> None:
        self._family = family
        self._values = values
        self._bucket = bucket
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, *extra: str) -> Any:
        """The child for the current priority; ``extra`` label values go before it."""
        key = (*extra, self._bucket())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._family.labels(*self._values, *key)
        return child

    def __getattr__(self, name: str) -> Any:
        return getattr(self.child(), name)


def scheduler_policy_info(registry: CollectorRegistry, label_names: tuple[str, ...],
                          label_values: tuple[str, ...]) -> Callable[[str], None]:
    """Create ``vllm:scheduler_policy_info``; returns the setter of the policy in force."""
    family = Gauge("vllm:scheduler_policy_info", "The scheduling policy in force (1) among those there are (0).",
                   (*label_names, "policy"), registry=registry)

    def set_policy(policy: str) -> None:
        for name in dict.fromkeys((*SCHEDULING_POLICIES, policy)):  # a fixed order: /metrics bytes stable
            family.labels(*label_values, name).set(1 if name == policy else 0)

    return set_policy
