"""Small utilities shared by benchmarks and entry points."""
