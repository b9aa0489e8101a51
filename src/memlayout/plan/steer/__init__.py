"""Application: a solved plan made real on a model (parameter formats, conversions)."""
