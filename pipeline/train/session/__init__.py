"""One training run from the driver's side: the session, its run directory, resume, fitting a run to its
data, and the record of what a run's data supplies."""
