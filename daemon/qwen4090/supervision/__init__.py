"""The daemon's state machine: the only code that changes the service's state."""
