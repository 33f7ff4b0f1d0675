"""aioreduce-bench: benchmarks that compare in one run and print ratios."""
