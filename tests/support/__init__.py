"""What the test tiers share: fakes for unit tests (fakes.py), the CPU vLLM runtime and its
config (runtime.py), and the one runner of real daemons and processes (daemon.py)."""
