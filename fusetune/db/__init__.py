"""fusetune's own tables (prefixed ft_), stored beside Optuna's in the same database."""
