"""An example fedsub plugin package: one file per extension (model.py, dataset.py, rule.py,
transform.py), each named in pyproject.toml's ``fedsub.plugins`` entry points."""
