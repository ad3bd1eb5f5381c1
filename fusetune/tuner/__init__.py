"""The offline tuner: search spaces, evaluation of configs, one Optuna study per point."""
