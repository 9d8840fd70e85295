"""inflight: RL for LLMs with in-flight weight updates."""

__version__ = "0.1.0"
