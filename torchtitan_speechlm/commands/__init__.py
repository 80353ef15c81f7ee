"""What users run: one module per ``torchtitan`` subcommand (``train``, ``export``, ``generate``
and ``eval``, ``serve``), and ``wandb_offline`` (read an offline wandb run back). Each is loaded
only when its subcommand runs (cli.py); ``*_args`` modules hold their parsers."""
