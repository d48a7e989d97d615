"""Example applications of forge_jax, run from the repository root as
``python -m examples.<name>`` (e.g. ``./dev.sh train`` runs
``python -m examples.train_digits``)."""
