"""The Parallel panel live on a real ``engine serve --data-parallel-size 2`` (the tiny
dummy-weight Llama of tests/test_data_parallel.py, two engine-core processes; slow: ~40 s to
start on two cores): the dashboard follows the server's /events (rank 0's snapshot, then
every rank's step and request events) while 16 requests run, and shows both ranks, while its
block map and queues stay rank 0's."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import httpx
import pytest

from engine.events.feed import HttpFeed
from monitor.app import MonitorApp
from monitor.widgets.parallel_panel import ParallelPanel
from tests.monitor.test_fleet_app import plain, until
from tests.test_data_parallel import _complete, dp_server  # noqa: F401  (the server fixture)

REQUESTS = 16
MAX_TOKENS = 12  # _complete's


@pytest.mark.slow
async def test_dashboard_follows_every_rank_of_a_dp_server(dp_server: dict[str, Any]) -> None:  # noqa: F811
    url = dp_server["url"]
    app = MonitorApp(feed=HttpFeed(url))
    async with app.run_test(size=(140, 50)) as pilot:
        await until(pilot, lambda: app.view.last_seq > 0 or app.view.parallel.num_ranks > 0, timeout_s=30)
        await pilot.press("2")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = await asyncio.get_running_loop().run_in_executor(
                None, lambda: list(pool.map(lambda i: _complete(url, i), range(REQUESTS))))
        assert statuses == [200] * REQUESTS
        routed = [r["routed"] for r in httpx.get(f"{url}/debug/state").json()["data_parallel"]["ranks"]]
        fold = app.view.parallel

        def generated(rank: int) -> float:
            readings = fold.ranks.get(rank)
            return readings[-1][4] if readings else 0.0

        # Every token each rank generated reached the fold: decode tokens plus one first token a request.
        await until(pilot, lambda: [generated(0), generated(1)] == [MAX_TOKENS * n for n in routed], timeout_s=30)
        await pilot.pause(0.3)  # the next tick draws what was folded
        panel = app.query_one(ParallelPanel)
        assert panel.display
        text = plain(panel)
        # The rest of the view is rank 0's alone: the requests it saw finish are the ones routed to rank 0.
        assert app.view.dp_rank == 0 and app.view.finished == routed[0] and not app.view.requests
    assert "2 DP ranks" in text and "verdict: " in text
    rows = [line.split() for line in text.splitlines()]
    assert {row[0] for row in rows if len(row) == 8 and row[0] in ("0", "1")} == {"0", "1"}
    assert "the block map, queues and step charts show DP rank 0" in text
