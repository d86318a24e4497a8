"""Load generation and benchmarks: trace replay, the pipeline and bus benchmarks."""
