"""Model definitions as pure functions over named parameter pytrees."""
