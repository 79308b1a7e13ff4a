"""The round loop and its stages: sampling, client work, evaluation."""
