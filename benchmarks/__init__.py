"""flashgen's GPU benchmarks, one entry point: ``python -m benchmarks <suite>``.

``python -m benchmarks list`` prints the suites (:mod:`benchmarks.suites`);
``python -m benchmarks plot KIND JSON... --out DIR`` redraws a suite's plots from its
JSON (:mod:`benchmarks.plots`).  The scripts behind the suites stay runnable on their
own (``python3 benchmarks/mods_bench.py --help``) and import their siblings by name.
"""
