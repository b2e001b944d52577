"""The command line, one module per subcommand (prepare, train (and the default `all`), eval, generate, export,
validate, runs_list) and what they share (checkpoint_arg, errors, unused_settings, interrupted, config_help).
`pipeline/run.py` parses the command line and dispatches to them; nothing else in the project imports them."""
