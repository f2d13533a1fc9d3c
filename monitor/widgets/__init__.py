"""Dashboard widgets, one per module. Each renders a view and nothing else.

- ``blocks_pane``: the Blocks tab: the block map beside the queues
- ``block_map``: the block map
- ``memory_bar``: the memory bar
- ``queues``: the running and waiting queues
- ``request_panel``: one request's life
- ``step_charts``: the step charts
- ``expert_load``: MoE expert load
- ``parallel_panel``: data-parallel ranks and pipeline stages
- ``startup_table``: phases A–G
- ``events_log``: the events log
- ``diagnosis``: the doctor's findings
- ``title_bar``, ``replay_bar``: the header and the replay bar
- ``goto_input``: the replay's step prompt
- ``legend``, ``numbers``, ``spark``: what they share: legends, numbers as read, sparklines
- ``fleet_table``, ``replica_panel``, ``prefix_map``, ``gpu_panel``: the fleet's and a replica's screens
"""
