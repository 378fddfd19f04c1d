"""KV transfer: the sender seam, the NIXL backend, the bootstrap server and the decode SDK."""
