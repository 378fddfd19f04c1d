"""The decode SDK: what a decode engine embeds to receive KV from a worker.

``receiver`` (``KVReceiver``, the public surface), ``link`` (the conversation with one worker),
``rooms`` (each wanted room and when it ends), ``io`` (waiting and the optional I/O thread),
``pool`` (a pool given as torch tensors), ``ranks`` (which attention-DP rank of a worker
serves a room). Import the public names from
``prefill_worker.transfer``. The SDK speaks the wire (``transfer.wire``, ``validate``,
``pagemap``, ``describe``) and uses the NIXL agent plumbing (``transfer.nixl.agent``); it
imports nothing of the prefill side's senders, backends or protocols.
"""
