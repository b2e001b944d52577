"""MLflow tracking from rank 0, the stable param, metric and tag names (names.py), and the training-curve plot.

Imports `pipeline.config` only; every stage may import it.
"""
