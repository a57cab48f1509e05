"""neuron_trio: the per-node GPU discovery and inference daemon.

Layers, imports pointing one way only (tests/test_layers.py enforces it):
config/errors/failpoints -> gpu -> engine -> parallel -> service -> http -> daemon/cli.
"""

__version__ = "0.1.0"
