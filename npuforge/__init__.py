"""npuforge: build per-SoC NPU binaries of language models from one checkpoint."""

__version__ = "0.1.0"
