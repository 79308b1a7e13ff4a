"""A run of a config, end to end: its checks, its set-up (data, model, schedule), the
experiment that trains and compares algorithms into a run folder, and the comparison report."""
