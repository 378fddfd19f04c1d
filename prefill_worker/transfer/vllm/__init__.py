"""vLLM's NIXL connector protocol, prefill side: vLLM decodes pull (NIXL READ) the KV this
worker registers. ``handshake``: the compatibility hash, the agent metadata and the ZMQ side
channel a vLLM decode handshakes with. Never imports vLLM.
"""
