"""Stage 2, shards to a trained model. At the top: the Ray-free engine (engine.py) and loop (loop.py), training in
one process (local.py) and under Ray Train (ray_train.py), the max-batch finder (max_batch.py). Its rooms:
checkpoints/ (the training state saved, loaded, checked and uploaded), distributed/ (DDP or FSDP, the process group,
collectives, elastic groups, retries), memory/ (the memory model, a device of a chosen size, hardware peaks), handoff/
(what leaves training: text generation from a checkpoint, the Hugging Face export), session/ (one run from the driver: phases, run directory, resume, sizing).

Imports `pipeline.config`, `pipeline.ray_runtime`, `pipeline.data`, `pipeline.eval` and `pipeline.tracking`; the
engine (engine.py, loop.py, local.py) imports neither Ray nor MLflow.
"""
