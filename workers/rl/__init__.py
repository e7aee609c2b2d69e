"""The RL engine: models, rollouts, trainer. Importable without the API; importing this package
imports no torch (each module imports its heavy libraries where they are used)."""
