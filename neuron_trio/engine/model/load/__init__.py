"""Loading a model file: read, pack, cache and restore its layers."""
