"""Stage 3, sweeps: Ray Tune over the one trainer, search-space files (tune_spaces/*.yaml) and sweep reports.

Imports `pipeline.config`, `pipeline.ray_runtime`, `pipeline.data`, `pipeline.train` and `pipeline.tracking`.
"""
