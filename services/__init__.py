"""Tandem services: sampler, trainer, inference, and the `tandem` command line."""
