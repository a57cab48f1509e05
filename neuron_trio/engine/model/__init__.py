"""The model: the transformer, its projections (one class per kernel), the paged KV cache, the loader and the native CPU kernel."""
