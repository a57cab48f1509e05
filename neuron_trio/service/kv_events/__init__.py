"""KV-cache events published to routers: the wire format and the publisher."""
