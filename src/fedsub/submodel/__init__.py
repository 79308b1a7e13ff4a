"""Submodels: which rows each client touches, how hot each row is, and moving rows in and out."""
