"""Comparing a layout's run with the same-dtype reference: tolerances, MoE routing decisions."""
