"""Quantized checkpoints: FP8 weights as DeepSeek-V3/R1, Qwen3-FP8 and ``compressed-tensors``
checkpoints ship them, read with their scales and turned into what the model computes with.

``spec`` (torch-free) reads a config's ``quantization_config`` into a ``QuantSpec``;
``fp8`` checks each FP8 tensor's scale and dequantizes this rank's slice of it;
``backends`` is the registry that decides what an FP8 weight becomes (dequantized, or kept
as shipped for ``block_gemm``'s block-scaled FP8 GEMM on a Hopper GPU), ``placement``
(torch-free) which weights the GEMM keeps, ``linear`` the one call the model's layers make
over either; ``memory`` (torch-free) is ``check-config``'s arithmetic of the same. The loader
calls these through small hooks (``check_scales`` and ``check_cuts`` before any read, the
backend's ``prepare`` after each).
"""
