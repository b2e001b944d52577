"""Stage 2, shards to a trained model: the Ray-free engine and loop, Ray Train glue, run sessions and run
directories, evaluation, generation, the max-batch finder and the device helpers they share.

Imports `pipeline.config`, `pipeline.ray_runtime`, `pipeline.data` and `pipeline.tracking`; the engine
(engine.py, loop.py, local.py) imports neither Ray nor MLflow.
"""
