"""What vLLM is launched with, and where: the plan, the checks, the GPU part."""
