"""The mutation benchmark's parts (benchmarks/bench_mutants.py runs them): ``hook`` (one mutant in a
job process), ``targets`` (the sites), ``stages`` (function -> pipeline stage), ``harm`` (ground
truth from the runs), ``doctor`` (the one adapter to the doctor), ``score`` (the figures),
``runner`` (jobs, clean runs, resuming)."""
