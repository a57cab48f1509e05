"""The actors: model actors, registry, watchdog and deadman, notifier, signals, drain."""
