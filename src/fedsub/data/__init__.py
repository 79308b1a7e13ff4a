"""Federated datasets: ragged sparse ids grouped by client, and their loaders."""
