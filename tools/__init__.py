"""Developer tools run from a clone (`python -m tools.<name>`); not installed, not benchmarks."""
