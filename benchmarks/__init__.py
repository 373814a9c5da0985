"""benchmarks: speed measurements (not tests); figures are recorded in BENCHMARKS.md."""
