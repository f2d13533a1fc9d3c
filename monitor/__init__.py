"""The ``monitor`` command: a Textual dashboard over kvscope's events, live or replayed, and
over other servers (vLLM or kvscope) from outside through ``/metrics`` and KV events.

- ``cli``: ``monitor follow / replay / vllm / record``
- ``app``: kvscope's dashboard, one layout live or replayed
- ``launch``: what ``engine … --monitor`` opens (the ``kvscope.dashboard`` entry point)
- ``sources``: where a dashboard's events come from
- ``state``: ``Timeline``, a seekable recording
- ``playback``: the replay's pace, by an injected clock's seconds
- ``replay_control``: the replay's keys: play, speed, steps, jumps
- ``rank_follow``: which data-parallel rank the dashboard follows
- ``live_updates``: the live feed drained into the dashboard each tick
- ``prometheus``: ``/metrics`` text into per-engine metrics
- ``kv_events``: vLLM's KV events read from the wire
- ``replica``: one replica's fold from outside
- ``poller``: ``/metrics`` polling, one task per replica
- ``external``: other servers' feeds, live or recorded
- ``record``: ``monitor record``
- ``fleet_app``: the fleet and replica screens
- ``gpu``, ``gpu_screen``: NVML readings and the GPU screen
- ``widgets``: one widget per file, each rendering a view
"""
