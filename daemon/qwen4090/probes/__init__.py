"""What asks vLLM and the GPU, and returns a result."""
