"""The worker process: `python -m launcher.train.loop RUN_DIR/recipe.yaml`, started by the
launcher (a spare runs it too and waits in `join()`). Model set-up, the step, evaluation,
durable checkpoints, metrics and the export. Nothing here imports the launcher's own process
(`launcher.run`, `launcher.bench`, `launcher.cli`)."""
