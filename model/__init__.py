"""Decoder-only language model: tiers, the model, FLOPs per token."""
