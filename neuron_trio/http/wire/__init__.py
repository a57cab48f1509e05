"""The HTTP/2 and TCP transport: hypercorn's fixes, floods, connections, bodies."""
