"""Decoder-only language model: tiers, the model, FLOPs per token, the decode loop (generate.py)."""
