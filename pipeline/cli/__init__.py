"""The command line's helpers: settings a command did not use, Ctrl+C, the `runs` list and `--help` of the
config. `pipeline/run.py` dispatches to them."""
