"""The plan as plain data (``Plan`` and its records), its text, and whole-model comparisons."""
