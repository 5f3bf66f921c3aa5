"""What the composition root wires around the supervisor: signals, status endpoint."""
