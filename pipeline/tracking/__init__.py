"""MLflow tracking from rank 0 (stable param and metric names) and the training-curve plot.

Imports `pipeline.config` only; every stage may import it.
"""
