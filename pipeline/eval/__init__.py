"""Evaluation beyond the mean validation loss, between data/ and train/ (train/ calls it; it uses the engine and
checkpoint loaders, never train/'s Ray glue): the loss of each source of a mixture (sources.py), loss by position in
the document (positions.py), rows longer than training used (long_rows.py), passkey retrieval (passkey.py) and the
eval stage that runs them on a checkpoint (stage.py)."""
