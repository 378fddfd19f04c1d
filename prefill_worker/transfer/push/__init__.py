"""The protocol-neutral push engine: one sender per request (``sender``), the hub that owns
peers, rooms, claims and refusals and drives every sender (``hub``), the rooms known without
a sender (``rooms``), bounded refusal tables (``refusals``), and the ``Dialect`` a protocol
implements (``dialect``). Imports neither ``transfer.native`` nor ``transfer.sglang``.
"""
