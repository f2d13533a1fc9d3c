"""One module per ``engine`` subcommand (``register`` + ``run``); see ``engine/cli/main.py``.

- ``serve``, ``generate``, ``run_workload``, ``demo``: run the real engine
- ``plan``, ``startup_report``: the memory plan and a start's phases
- ``simulate``, ``replay``, ``diff``, ``capacity``: the model-free executors and their comparisons
- ``doctor``: findings with their fixes
- ``export_hf``, ``build_kernels``, ``bench_scheduler``: a model's HF export, the CPU kernels, the scheduler's speed
"""
