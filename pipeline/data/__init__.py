"""Stage 1, raw text to shards: corpus readers -> SentencePiece tokenizer -> Ray Data tokenize and pack ->
Parquet shards + manifest -> validation, and the Ray-free / Ray Data shard readers that training uses.

Imports `pipeline.config` (and `pipeline.mixture_spec` beside it) and `pipeline.ray_runtime` only (never train/,
sweep/, tracking/ or the CLI).
"""
