"""What users run: one module per ``torchtitan`` subcommand (``train``, ``prepare``, ``export``,
``generate`` and ``eval``, ``serve``, ``prefer``), and ``wandb_offline`` (read an offline wandb
run back). Each is loaded only when its subcommand runs (cli.py); ``*_args`` modules hold their
settings (standard library only, parsed before the command is imported).

Each command is a Python function taking its settings whole: an ``*Args`` dataclass, one field
per flag, from which the command's parser is generated (flag_fields.py) and whose ``validate``
checks it once:

- ``prepare(PrepareArgs)`` (prepare.py, prepare_args.py);
- ``export_command(ExportArgs)`` (export.py, export_args.py; ``export(checkpoint, out_dir)``
  is the work itself);
- ``generate(GenerateArgs)`` and ``evaluate(EvalArgs)`` (generate.py, generate_args.py);
- ``serve(ServeArgs)`` (serve.py, serve_args.py);
- train: its settings are torchtitan's config (a TOML and ``--section.key`` overrides), so its
  entry points are ``train_command(argv)`` (train.py, what the console script runs) and, from
  Python, ``torchtitan_speechlm.TitanTrainer(...).run()`` (python_api/trainer.py).

``main(argv)`` (``generate_main``, ``eval_main``) parses a command line into the settings and
calls the function; ``prefer`` (prefer.py) calls ``evaluate`` and ``prepare`` with values it
builds, and ``train_command`` in a process of its own.

A flag's name has one meaning across commands: ``--out`` is a FILE in generate and eval (a wav
or text; the results' JSON), ``--out-dir`` a FOLDER (export's model folder, generate's batch
outputs, prepare's dataset: a folder, or a URL it is uploaded to), ``--job.config_file`` the
training TOML (train, prefer), ``--model`` the model read (generate, eval, serve; export's
``--checkpoint``). A renamed flag keeps its old spelling as an alias that says the new one when
used (flag_fields.py ``renamed``: export's and prepare's ``--out``).
"""
