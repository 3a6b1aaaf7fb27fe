"""Plans and builds FP8 TensorRT-LLM engines and the Triton model repository that serves them."""
