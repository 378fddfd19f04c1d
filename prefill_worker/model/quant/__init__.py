"""Quantized checkpoints: FP8 weights as DeepSeek-V3/R1, Qwen3-FP8 and ``compressed-tensors``
checkpoints ship them, read with their scales and turned into what the model computes with.

``spec`` (torch-free) reads a config's ``quantization_config`` into a ``QuantSpec``;
``fp8`` checks each FP8 tensor's scale and dequantizes this rank's slice of it;
``backends`` is the registry a CUDA FP8 GEMM plugs into. The loader calls these through two
small hooks (``check_scales`` after the shape check, ``dequantize`` after each read).
"""
