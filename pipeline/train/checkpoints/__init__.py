"""Checkpoints: saving and loading the training state, which of a run's checkpoints are complete, the
one-line diagnosis of a broken one, `validate`, and Ray Train's upload of each."""
