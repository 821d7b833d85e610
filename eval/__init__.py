"""Evaluation against the served engine: `dflash eval`."""
