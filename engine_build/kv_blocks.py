"""The KV-cache block size, as the model repository records it: read by the engine server, which
runs where the serving stack's client packages (tritonclient) are not installed, so this module
imports nothing."""

# Not a backend parameter (TensorRT-LLM reads the size from the engine, built with
# `trtllm-build --tokens_per_block`): `engine-build repo` writes the value it built with, so the
# engine server and the gateway count blocks of the same size.
TOKENS_PER_BLOCK_PARAMETER = "tokens_per_block"
# TensorRT-LLM 1.2's build default (PluginConfig.tokens_per_block): the size where a config.pbtxt
# does not record one.
DEFAULT_TOKENS_PER_BLOCK = 32
