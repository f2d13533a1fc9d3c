"""The kernel plan: which implementation multiplies each projection group at each step size,
chosen by timing every candidate on this CPU with the model's own weights.

Constants tuned on one CPU pick the wrong path on another (issue 34: an AMX Xeon ran its
500-token prefills through the int8-activation GEMV that wins on AVX2, at 40 % of vLLM's
speed, while its bf16 GEMM was 4x faster). So at the first start for a (weights, weight
formats, dtype, ISA, torch, kernel sources, threads) the engine times, for each group
(QKV, O, gate/up, down on one layer, and the LM head; each on at most its first
``WEIGHT_ROWS_TIMED`` output rows, time being linear in them, and scaled to the whole weight) and each step-size class the scheduler makes (``STEP_CLASSES``:
1, 2-8, 9-16, 17-32, 33-64, 65+, one representative row count each), the candidates this machine has:

* ``gemv``: kvscope's GEMV over the GGUF blocks (q4_1x8: int8 activations; q4_1 and q8_0:
  float activations), engine/model/kernels/cpu_gemv.py;
* ``x16``: the weight's blocks regrouped 16 rows at a time at load (int8 values, fp32 scales:
  lossless), multiplied with int8 activations, 16 outputs per vpdpbusd
  (engine/model/kernels/cpu_quant.py; offered where the AVX-512 VNNI build runs): the many-row
  GEMM over the file's own blocks, about twice the plain GEMV's speed past 8 rows;
* ``torch``: ``F.linear`` over the model's float weights (fp32 GEMM for an fp32 model);
* ``fp32pack``: oneDNN's linear over a float32 copy packed once (float32 sums: the LM head too);
* ``bf16``: oneDNN's linear over a bf16 copy packed once (AMX or AVX512-BF16), only where bf16 is
  native, never for the LM head (its output would be rounded to bf16 before the fp32
  logits: greedy decoding would pick among bf16 ties);
* ``int8pack``: torch's ``_weight_int8pack_mm`` over per-channel int8 weights, where torch has it;
* ``fused``: the whole decode layer as one C++ call over the GGUF blocks (its GEMV at every size;
  engine/model/kernels/cpu_layer.py), timed against the op-by-op layer on the chosen
  projections at every class, for pure-decode steps up to where it stops winning;
* ``attn`` (prefill attention, ``ATTENTION``): one causal chunk over the paged cache at the
  multi-row classes: torch SDPA over the gathered context in float32, or on q, K and V rounded
  to bf16 (where bf16 is native and ``--dtype auto``), or kvscope's paged prefill kernel.

The LM head's candidates take float32 rows and return float32 sums in every dtype mode (a bf16
weight is widened slice by slice: engine/model/layers/projection_linear.py ``fp32_linear``). A float weight that
no chosen candidate multiplies by is dropped once the plan is installed (layers/kernel_routing.py
``drop_unused_float_weights``; phase C counts what is held).

Each candidate's output is checked against the fp32 reference ``x @ W.T`` on the same
inputs (relative RMS error at most ``ACCURACY_BOUND``; the GEMV against its own blocks'
values in fp32, which are ``W`` for a GGUF's blocks and the weights ``--quantization`` chose
for packed ones); the fastest that passes is chosen.
A candidate more than ``PRUNE_FACTOR`` x slower than the best at one class is not timed at
the bigger ones. Measuring stops at ``MEASURE_BOUND_S`` (``FIRST_MEASURE_BOUND_S`` for a model's
first plan here): cells not reached run the last quiet plan's choice (else the fallback constants',
never the row-by-row GEMV past one row for a weight held only as blocks), say so, and are measured
at the next start (the stored plan is resumed). The plan is stored beside phase D's profile
(``kernel_plans/<key>.json`` under engine/model/memory/profile_cache.py's folder) so a warm start reuses it, and ``KVSCOPE_KERNEL_PLAN``
pins one (a path or the JSON itself), ``measure`` measures again, ``off`` runs the fallback
constants (``GEMV_MAX_ROWS`` in engine/model/layers/kernel_routing.py and the ISA's dtype rule).


Modules:

- ``kernel_plan``: ``KernelPlan`` and its cells, groups and step classes, as stored
- ``setting``: ``KVSCOPE_KERNEL_PLAN`` and what ``--dtype auto`` means with the plan on
- ``candidates``: each candidate's implementation and the copies it keeps
- ``routes``: a projection's implementation by step size
- ``choice``: a cell's error check, interleaved timing and choice
- ``measurement``: every group's cells measured on the model's weights
- ``attention_cells``: prefill attention's cells
- ``fused_layer``: the fused decode layer timed against the op-by-op layer
- ``stability``: plans that hold still: margins and load
- ``store``: stored, listed and pinned plans
- ``token_budget``: the CPU token budget from the plan's prefill speed
- ``resolve``: the plan a start runs
"""
