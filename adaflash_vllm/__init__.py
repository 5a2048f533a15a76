"""AdaFlash-vLLM: adaptive DFlash speculative decoding as a vLLM plugin."""

__version__ = "0.1.0"
