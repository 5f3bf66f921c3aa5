"""One vLLM process and what runs beside it, the front on the client port among them."""
