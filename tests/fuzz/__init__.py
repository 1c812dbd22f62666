"""A graph fuzzer: random FlowGraphs (hypothesis strategies), compiled on the CPU and checked
against the graph's numpy reference.

- `spec.py`: a fuzzed graph as plain data (`GraphSpec`): inputs with value domains, operators,
  outputs with tolerances, and the symbol values of each run; builds it into a GraphBuilder,
  makes its inputs, writes it as JSON and as a standalone Python reproducer.
- `generate.py`: the hypothesis strategy `graph_specs()`, which tracks every tensor's run-time
  shapes, value interval and error bound, so that generated graphs stay finite, in range and
  comparable with justified tolerances; `actions.py` and `actions_nn.py` are the operator
  families it draws from.
- `check.py`: packs many specs into one FlowGraph (disjoint components; compile cost is the
  bottleneck), compiles it, calls it on fresh inputs per run with canaries around every buffer,
  attributes every mismatch, crash and refusal to its component, and minimizes failing specs.
- `driver.py`: generation, batches in forked processes (a kernel that corrupts memory or hangs
  is bisected down to its graph), reproducers and the report; `run.py` is the command line
  (10,000 graphs by default), outside CI; `tests/test_graph_fuzz.py` runs 600 with a fixed seed.
"""
