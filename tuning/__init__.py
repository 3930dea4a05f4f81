"""The tune command's companions: benchmarks, A/B comparisons, accuracy, sanitizer cases and
profiling launches. Run each from the repository root as a module (``python -m tuning.bench``);
GPU timing comes from tuning/timing.py. tuning/README.md lists them."""
