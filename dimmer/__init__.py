"""Dimmer: keep an AI training campus inside its electrical limits without stopping the training."""

__version__ = "0.1.0"
