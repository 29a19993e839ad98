"""exo: distributed LLM inference on MLX with native multi-token-prediction speculative decoding."""

__version__ = "0.1.0"
