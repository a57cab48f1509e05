"""What the node reports about itself: /v1/node, `neuron status`, load reports."""
