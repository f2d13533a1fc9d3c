"""``r`` on a live ``engine serve --data-parallel-size 2`` (the tiny dummy-weight Llama of
tests/test_data_parallel.py, two engine-core processes; slow: ~40 s to start on two cores):
the dashboard asks the server for rank 1's state (``/debug/state?dp_rank=1``) while requests
run on both ranks, and from then on shows rank 1's requests and blocks and folds rank 1's
events: once every request finished, the count it shows is exactly what the balancer routed
to rank 1 (nothing folded twice, nothing missed across the hand-over)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import httpx
import pytest

from engine.events.feed import HttpFeed
from monitor.app import MonitorApp
from monitor.widgets.block_map import BlockMap
from monitor.widgets.queues import RequestTable
from monitor.widgets.title_bar import TitleBar
from tests.monitor.test_fleet_app import until
from tests.monitor.test_monitor_layout import widget_lines
from tests.test_data_parallel import dp_server  # noqa: F401  (the server fixture)

REQUESTS = 32  # 16 a rank behind --max-num-seqs 8: a second wave queues behind the first
MAX_TOKENS = 250  # the most a 5-token prompt gets under the server's --max-model-len 256


def _generate(url: str, index: int) -> int:
    body = {"prompt": [5 + index, 17, 29, 31, 40 + index], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code


def _requests_of(url: str, rank: int, states: tuple[str, ...] = ("running", "waiting")) -> set[str]:
    """The server's own account (``/debug/requests``: each row says its rank)."""
    rows = httpx.get(f"{url}/debug/requests").json()["requests"]
    return {row["id"] for row in rows if row["dp_rank"] == rank and row["state"] in states}


@pytest.mark.slow
async def test_r_follows_rank_1_of_a_live_dp_server(dp_server: dict[str, Any]) -> None:  # noqa: F811
    url = dp_server["url"]
    app = MonitorApp(feed=HttpFeed(url))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.dp_ranks() == [0, 1], timeout_s=30)  # the snapshot seeds both ranks
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            done = [loop.run_in_executor(pool, _generate, url, i) for i in range(REQUESTS)]
            await until(pilot, lambda: len(_requests_of(url, 1)) >= 2 and len(_requests_of(url, 0)) >= 2,
                        timeout_s=60)
            assert app.view.dp_rank == 0 and "◆ DP rank 0 of 2" in " ".join(widget_lines(app.query_one(TitleBar)))
            await pilot.press("r")
            await until(pilot, lambda: app.view.dp_rank == 1 and app.asked_rank is None, timeout_s=30)
            await pilot.pause(0.3)
            shown = {str(k.value) for t in ("running", "waiting")
                     for k in app.query_one(f"#{t}-table", RequestTable).rows}
            owners = {rid for held in app.query_one(BlockMap).owners_by_block().values() for rid in held}
            header = " ".join(widget_lines(app.query_one(TitleBar)))
            statuses = await asyncio.gather(*done)
        assert statuses == [200] * REQUESTS
        assert "◆ DP rank 1 of 2" in header
        everyone = ("running", "waiting", "finished")
        assert shown and shown <= _requests_of(url, 1, everyone) and not shown & _requests_of(url, 0, everyone)
        assert owners <= shown
        routed = [r["routed"] for r in httpx.get(f"{url}/debug/state").json()["data_parallel"]["ranks"]]
        assert min(routed) >= 2 and sum(routed) == REQUESTS
        await until(pilot, lambda: app.view.finished == routed[1] and not app.view.requests, timeout_s=30)
