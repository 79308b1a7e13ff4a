"""``fedsub reproduce``: every table and figure of the five seeds as an experiment id
(``registry.py``: what runs, on which data, against which of the paper's numbers, kept in
``paper_numbers.toml``), run and judged by ``running.py``; the two closed-form experiments
(seed 001's Example 1, seed 004's Theorem 4) are in ``closed_forms.py``."""
