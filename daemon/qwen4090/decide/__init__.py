"""What the parts answer, as values, and the pure decisions on it: policy, the judges."""
