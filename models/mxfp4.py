"""gpt-oss's experts as its hub checkpoints store them: MXFP4, read slice by slice.

openai/gpt-oss-20b keeps each expert projection as `<name>_blocks` (uint8, two 4-bit values a
byte, 32 values a block: [experts, out, in / 32, 16]) and `<name>_scales` (one power-of-two
exponent a block, biased by 127: [experts, out, in / 32]); the model trains the dequantized
parameter `<name>`, [experts, in, out] (the projection transposed). A rank reads the blocks and
scales of its own experts (FSDP2 shards dimension 0) and of its own output rows, and turns them
into values with transformers' own dequantization (`convert_moe_packed_tensors`), so no rank
holds the whole expert tensor, quantized or not.
"""
from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"


def packed_key(name: str, where) -> str | None:
    """The `_blocks` key of parameter key `name` when the checkpoint stores it as MXFP4."""
    if name + BLOCKS in where and name + SCALES in where:
        return name + BLOCKS
    return None


def is_packed(key: str) -> bool:
    return key.endswith(BLOCKS)


def logical_shape(blocks_shape) -> tuple:
    """The trained parameter's shape: [experts, in, out] from blocks [experts, out, in/32, 16]."""
    experts, out, groups, half = blocks_shape
    return (experts, groups * half * 2, out)


def read(blocks_slice, scales_slice, index, dtype) -> tuple[torch.Tensor, int]:
    """(this rank's part `index` of the parameter's [experts, in, out], dequantized; the
    elements read). The experts and output rows are cut before reading (dimensions 0 and 1 of
    the blocks), the inputs after dequantizing (they are packed inside each row)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    experts, inputs, outputs = index or (slice(None),) * 3
    blocks = blocks_slice[experts, outputs]
    scales = scales_slice[experts, outputs]
    part = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [experts, in, out]
    return part[:, inputs, :].contiguous(), blocks.numel() + scales.numel()


def drop_quantization(config) -> None:
    """The trained model is full precision whatever its checkpoint stores (the quantized experts
    are dequantized as they are read): its config, and so its export, says no quantization."""
    if getattr(config, "quantization_config", None) is not None:
        delattr(config, "quantization_config")
