"""Checks of a built plan: the guard's whole-model timing, peak memory, verification."""
