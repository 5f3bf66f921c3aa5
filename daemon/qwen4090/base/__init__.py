"""The bottom layer: states, events, what vLLM says and does, logs, small machine parts."""
