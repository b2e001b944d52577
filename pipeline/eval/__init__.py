"""Evaluation beyond the mean validation loss, between data/ and train/ (train/ and the eval command,
pipeline/cli/eval.py, call it with a loaded engine and the dataset's manifest; it imports neither): the loss of each
source of a mixture (sources.py), loss by position in the document (positions.py), rows longer than training used
(long_rows.py), passkey retrieval (passkey.py), and the long-context measures run together and logged
(long_context.py)."""
