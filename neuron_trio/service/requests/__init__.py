"""A request's path through a model actor: intake, the queue, events, limits."""
