"""PithTrain: a compact training system for mixture-of-experts language models."""

__version__ = "0.1.0"
