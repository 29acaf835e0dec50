"""Benchmarks: commands that print a table with their baseline measured in the same run."""
