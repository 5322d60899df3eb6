"""splitspec: a 2-bit base on the GPU, the residual on the CPU, tree speculative decoding."""

__version__ = "0.1.0"
