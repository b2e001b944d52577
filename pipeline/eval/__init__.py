"""Evaluation beyond the mean validation loss, between data/ and train/ (train/ calls it; it never imports train/'s
Ray glue): the loss of each source of a mixture (sources.py)."""
