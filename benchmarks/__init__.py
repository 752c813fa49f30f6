"""exlnb benchmarks: `python -m benchmarks`."""
